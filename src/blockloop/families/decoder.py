"""The vanilla decoder family: GPT-NeoX/Pythia and Llama shapes, the paper sizes and the CPU test sizes.

Its config is :class:`blockloop.config.DecoderConfig`, the plain transformer the other families build
their stacks from. Sizes in preset names are non-embedding parameters, as in the Block Transformer paper's
Table 3, whose vanilla models use Pythia's architecture (parallel residual, 25% rotary, LayerNorm, GELU,
untied embeddings, vocabulary 50,304, context 2,048).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from blockloop.config import DecoderConfig
from blockloop.families.costs import (
    attention_flops,
    layer_weights,
    paper_kv_cache_bytes,
    param_bytes,
    windowed_kv_cache_bytes,
)
from blockloop.families.spec import FamilySpec, Preset
from blockloop.models.decoder import Decoder

PYTHIA = {"vocab_size": 50304, "context_length": 2048, "norm": "layernorm", "mlp": "gelu", "bias": True,
          "rotary_pct": 0.25, "parallel_residual": True, "tie_embeddings": False}
# RMSNorm, SwiGLU, no biases, tied embeddings; byte-level vocabulary for CPU-sized runs.
LLAMA_TINY = {"vocab_size": 258, "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "tie_embeddings": True}
# The double-decoder paper (Alexander et al. 2026), section 4 and Table 1: tied embeddings, RoPE, head dim 64
# (n_head = d / 64), Xavier-uniform init, 32k BPE, context 2048; 8 context / 4 generation layers (12 for
# decoder-only), 10/5 for the smallest models. The paper gives parameter targets (6.25M-100M), not widths:
# ours are the multiples of 64 nearest the target in non-embedding parameters. A.2 counts two FF layers of
# 4d (16Td^2), so the MLP is the plain GELU one. Sizes: (context layers, generation layers, width).
PAPER_SIZES = {"6m": (10, 5, 192), "25m": (8, 4, 384), "100m": (8, 4, 832)}


def paper_shape(d_model: int) -> dict[str, Any]:
    """The double-decoder paper's shared fields at width ``d_model`` (its three families all use them)."""
    return {"vocab_size": 32000, "context_length": 2048, "n_head": d_model // 64, "d_model": d_model,
            "norm": "rmsnorm", "mlp": "gelu", "bias": False, "tie_embeddings": True, "init": "xavier_uniform"}


def llama_tiny(n_layer: int, d_model: int, n_head: int, n_kv_head: int, context_length: int) -> dict[str, Any]:
    """A Llama-style shape of the tiny/demo sizes."""
    return {**LLAMA_TINY, "n_layer": n_layer, "d_model": d_model, "n_head": n_head, "n_kv_head": n_kv_head,
            "context_length": context_length}


PRESETS = (
    *(Preset(f"pythia-{size}", f"Pythia shape, {size.upper()} non-embedding (Block Transformer Table 3 vanilla)",
             {**PYTHIA, "n_layer": n_layer, "d_model": d, "n_head": h})
      for size, (n_layer, d, h) in {"5m": (6, 256, 8), "19m": (6, 512, 8), "85m": (12, 768, 12),
                                    "302m": (24, 1024, 16)}.items()),
    Preset("tiny", "2-layer Llama-style model (RMSNorm, SwiGLU, GQA, tied) for CPU tests", llama_tiny(2, 64, 4, 2, 128)),
    Preset("tiny-neox", "2-layer Pythia-style model (parallel residual, partial rotary, untied) for CPU tests",
           {**PYTHIA, "n_layer": 2, "d_model": 64, "n_head": 4, "vocab_size": 258, "padded_vocab_size": 258,
            "context_length": 128}),
    Preset("demo", "4-layer Llama-style model the CPU demo trains in a few minutes", llama_tiny(4, 128, 4, 4, 256)),
    *(Preset(f"paper-decoder-{size}", f"decoder-only, {n_ctx + n_gen} layers, d={d} (double-decoder paper, ~{size} "
             "non-embedding)", {**paper_shape(d), "n_layer": n_ctx + n_gen})
      for size, (n_ctx, n_gen, d) in PAPER_SIZES.items()),
)


def training_flops(config: DecoderConfig, seq_len: int, *, lm_head: bool = True) -> float:
    """Training FLOPs of one window of ``seq_len`` tokens: 6 per weight per token plus the attention
    products over the whole (unmasked) T^2, as appendix A.2 counts them; with ``lm_head`` the head too."""
    w = layer_weights(config)
    head = config.d_model * config.padded_vocab_size if lm_head else 0
    T = seq_len
    return 6 * T * (config.n_layer * sum(w.values()) + head) + attention_flops(config) * config.n_layer * T**2


def paper_training_flops(seq_len: int, d_model: int, n_layer: int) -> float:
    """Appendix A.2: L (72 T d^2 + 12 T^2 d) (multi-head attention, 4d GELU MLP, no LM head)."""
    return n_layer * (72 * seq_len * d_model**2 + 12 * seq_len**2 * d_model)


def paper_kv_bytes(d_model: int, n_layer: int, n_dec_layer: int, in_len: int, out_len: int,
                   bytes_per_value: int = 2) -> int:
    """Appendix A.1: every layer keeps K/V of the prompt and the generated tokens."""
    return paper_kv_cache_bytes(d_model, n_layer, in_len, out_len, bytes_per_value)


def kv_bytes(config: DecoderConfig, prompt_len: int, new_tokens: int, bytes_per_value: int = 2) -> int:
    """K/V of every layer for the prompt and the generated tokens (the last ``sliding_window`` of them in
    local layers, whose caches roll)."""
    tokens = prompt_len + new_tokens
    return windowed_kv_cache_bytes(config, config.n_layer, len(config.local_layers), tokens, bytes_per_value)


def decode_bytes_per_step(model: nn.Module, batch: int, prompt_len: int, gen_len: int) -> float:
    """All weights (an untied input embedding is only looked up), plus K and V of every layer for the
    ``P + G/2`` tokens of the average row (at most ``sliding_window`` of them in local layers)."""
    c = model.config
    element = next(model.parameters()).element_size()
    weights = param_bytes(model) - model.embed.weight.numel() * element * (not c.tie_embeddings)
    average = prompt_len + gen_len / 2
    return weights + batch * windowed_kv_cache_bytes(c, c.n_layer, len(c.local_layers), average, element)


SPEC = FamilySpec(
    name="decoder",
    config_class=DecoderConfig,
    model_class=Decoder,
    scoring="cached",
    presets=PRESETS,
    training_flops=training_flops,
    kv_bytes=kv_bytes,
    decode_bytes_per_step=decode_bytes_per_step,
    paper_training_flops=paper_training_flops,
    paper_kv_bytes=paper_kv_bytes,
)
