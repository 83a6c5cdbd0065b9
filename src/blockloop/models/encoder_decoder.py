"""The standard encoder-decoder baseline (Vaswani et al. 2017; T5, Raffel et al. 2020), as compared in the
double-decoder paper (sections 2, 4).

A bidirectional encoder reads the input; each decoder layer has causal self-attention, then a separate
cross-attention to the encoder's final states (its own softmax, added residually - the combination the
double decoder replaces with one joint softmax), then the MLP. One tied embedding serves both stacks and
the LM head. Rotary positions are used in the two self-attentions; cross-attention is position-free.

Pretraining is span corruption (:mod:`blockloop.data.span_corruption`); the PrefixLM phase routes the
prefix through the encoder and decodes the suffix. Generation encodes prompt[:-1] once, computes each
layer's cross K/V once, and starts decoding at the last prompt token, exactly like the double decoder,
with a KV cache for the decoder's self-attention only (appendix A.1): the serving runner
(:mod:`blockloop.serve.runners.encoder_decoder`) calls :meth:`EncoderDecoder.encode` once per prompt and
:meth:`EncoderDecoder.decoder_step` once per token. A prompt prefix cannot be cached:
with a bidirectional encoder every state depends on the whole prompt (section 3.3, item 3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from blockloop.errors import check_context
from blockloop.models.decoder import Block, CrossKV, LanguageModel
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.masks import padding_mask
from blockloop.nn.norm import build_norm
from blockloop.nn.paged_cache import KVPages
from blockloop.nn.rope import rope_angles

if TYPE_CHECKING:
    from blockloop.families.encoder_decoder import EncoderDecoderConfig


class EncoderDecoder(LanguageModel):
    def __init__(self, config: EncoderDecoderConfig) -> None:
        super().__init__(
            config,
            encoder=nn.ModuleList(Block(config) for _ in range(config.n_encoder_layer)),
            encoder_norm=build_norm(config.norm, config.d_model, config.norm_eps),
            decoder=nn.ModuleList(Block(config, cross_attention=True) for _ in range(config.n_decoder_layer)),
        )

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        decoder_idx: Tensor,
    ) -> tuple[Tensor, Tensor | None]:
        """Logits ``(B, T_out, V)`` for ``decoder_idx`` given the encoder input ``idx (B, T_in)``."""
        check_context(max(idx.shape[1], decoder_idx.shape[1]), self.config.context_length, "encoder or decoder input")
        cross, cross_mask = self.encode(idx)
        positions = torch.arange(decoder_idx.shape[1], device=idx.device)
        cos, sin = rope_angles(positions, self.config.rotary_dim, self.config.rope_base)
        logits = self._decode(decoder_idx, cos, sin, cross, cross_mask)
        return logits, self.loss(logits, targets)

    def encode(self, idx: Tensor, valid: Tensor | None = None) -> tuple[list[CrossKV], Tensor]:
        """Bidirectional encoder over ``idx``; returns every decoder layer's cross K/V and the key mask.

        An empty input (a one-token prompt leaves the encoder nothing) is one padding position no query sees, so
        the decoder's cross-attention adds zeros, as attention over no key does."""
        batch, length = idx.shape
        if length == 0:
            idx, valid = idx.new_zeros(batch, 1), torch.zeros(batch, 1, dtype=torch.bool, device=idx.device)
        if valid is None:
            valid = torch.ones(batch, length, dtype=torch.bool, device=idx.device)
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        cos, sin = rope_angles(positions, self.config.rotary_dim, self.config.rope_base)
        mask = padding_mask(valid)
        x = self.drop(self.embed(idx))
        for block in self.encoder:
            x = block(x, cos, sin, mask=mask)
        memory = self.encoder_norm(x)
        return [layer.cross.keys(memory) for layer in self.decoder], valid[:, None, None, :]

    def _decode(self, idx: Tensor, cos: Tensor, sin: Tensor, cross: list[CrossKV], cross_mask: Tensor, *,
                step: StepContext | None = None) -> Tensor:
        x = self.drop(self.embed(idx))
        mask = step.begin() if step is not None else None
        for i, layer in enumerate(self.decoder):
            x = layer(x, cos, sin, cross[i], cross_mask, mask=mask, kv=step.layer(i) if step is not None else None)
        return self.logits(self.norm(x))

    # ------------------------------------------------------------ inference
    def allocate_cache(self, batch_size: int, max_len: int, *, pages: KVPages | None = None) -> DecoderCache:
        """The KV cache for the decoder's self-attention (static, or paged over ``pages``)."""
        c, weight = self.config, self.embed.weight
        return DecoderCache(c.n_decoder_layer, batch_size, c.n_kv_head, max_len, c.head_dim,
                            dtype=weight.dtype, device=weight.device, pages=pages)

    def decoder_step(self, tokens: Tensor, step: StepContext, cross: list[CrossKV], cross_mask: Tensor) -> Tensor:
        """One token per row ``tokens (B,)`` through the decoder (its cache + the fixed cross K/V); the
        next-token logits ``(B, V)``."""
        cos, sin = rope_angles(step.token_positions, self.config.rotary_dim, self.config.rope_base)
        return self._decode(tokens[:, None], cos, sin, cross, cross_mask, step=step)[:, -1]
