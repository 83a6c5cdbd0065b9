"""Weight initialisation shared by every model family.

``normal`` is GPT-2's: N(0, std) for matrices and embeddings, with residual output projections (the
``proj`` of an attention, cross-attention or MLP, :data:`RESIDUAL_OUTPUTS`) scaled by 1/sqrt(2 n_layer): each
layer adds two of them to the residual stream. Other projections (a block embedder's) keep std. ``xavier_uniform`` is what the double-decoder paper uses
for all its families (Table 1). Either way biases start at zero and norms at identity (weight 1, or 0 for
Gemma's 1 + weight RMSNorm).
"""

from __future__ import annotations

import math

from torch import nn

from blockloop.nn.norm import LoopNorm, RMSNorm

RESIDUAL_OUTPUTS = (".attn.proj", ".cross.proj", ".mlp.proj")  # module names that end with one are scaled


def init_weights(model: nn.Module, *, std: float, n_layer: int, scheme: str = "normal") -> None:
    if all(p.is_meta for p in model.parameters()):
        return  # shapes only (counting parameters, weights loaded later): nothing to draw, and drawing on meta is slow
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if scheme == "xavier_uniform":
                nn.init.xavier_uniform_(module.weight)
            else:
                scale = 1 / math.sqrt(2 * n_layer) if name.endswith(RESIDUAL_OUTPUTS) else 1.0
                nn.init.normal_(module.weight, mean=0.0, std=std * scale)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, RMSNorm, LoopNorm)):
            nn.init.constant_(module.weight, 1.0 - getattr(module, "offset", 0.0))
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
