"""The standard encoder-decoder baseline (Vaswani et al. 2017; T5, Raffel et al. 2020), as compared in the
double-decoder paper (sections 2, 4).

A bidirectional encoder reads the input; each decoder layer has causal self-attention, then a separate
cross-attention to the encoder's final states (its own softmax, added residually - the combination the
double decoder replaces with one joint softmax), then the MLP. One tied embedding serves both stacks and
the LM head. Rotary positions are used in the two self-attentions; cross-attention is position-free.

Pretraining is span corruption (:mod:`blockloop.data.span_corruption`); the PrefixLM phase routes the
prefix through the encoder and decodes the suffix. Generation encodes prompt[:-1] once, computes each
layer's cross K/V once, and starts decoding at the last prompt token, exactly like the double decoder,
with a KV cache for the decoder's self-attention only (appendix A.1). A prompt prefix cannot be cached:
with a bidirectional encoder every state depends on the whole prompt (section 3.3, item 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from blockloop.models.decoder import Block, CrossKV, LanguageModel
from blockloop.nn.kv_cache import DecoderCache
from blockloop.nn.norm import build_norm
from blockloop.nn.rope import rope_angles

if TYPE_CHECKING:
    from blockloop.families.encoder_decoder import EncoderDecoderConfig


@dataclass
class EncDecState:
    cache: DecoderCache
    cross: list[CrossKV]
    cross_mask: Tensor
    next_slot: int


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
        encoder_valid: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Logits ``(B, T_out, V)`` for ``decoder_idx`` given the encoder input ``idx (B, T_in)``."""
        if max(idx.shape[1], decoder_idx.shape[1]) > self.config.context_length:
            raise ValueError(f"encoder or decoder input exceeds the model context of {self.config.context_length}")
        cross, cross_mask = self.encode(idx, encoder_valid)
        positions = torch.arange(decoder_idx.shape[1], device=idx.device)
        cos, sin = rope_angles(positions, self.config.rotary_dim, self.config.rope_base)
        logits = self._decode(decoder_idx, cos, sin, cross, cross_mask)
        return logits, self.loss(logits, targets)

    def encode(self, idx: Tensor, valid: Tensor | None = None) -> tuple[list[CrossKV], Tensor]:
        """Bidirectional encoder over ``idx``; returns every decoder layer's cross K/V and the key mask."""
        batch, length = idx.shape
        if valid is None:
            valid = torch.ones(batch, length, dtype=torch.bool, device=idx.device)
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        cos, sin = rope_angles(positions, self.config.rotary_dim, self.config.rope_base)
        key_mask = valid[:, None, None, :]
        # A padding query sees the real keys (or itself in an all-padding row), so every row stays finite.
        own = torch.eye(length, dtype=torch.bool, device=idx.device)
        x = self.drop(self.embed(idx))
        for block in self.encoder:
            x = block(x, cos, sin, mask=key_mask | own)
        memory = self.encoder_norm(x)
        return [layer.cross.keys(memory) for layer in self.decoder], key_mask

    def _decode(self, idx: Tensor, cos: Tensor, sin: Tensor, cross: list[CrossKV], cross_mask: Tensor, *,
                cache: DecoderCache | None = None, slots: Tensor | None = None) -> Tensor:
        x = self.drop(self.embed(idx))
        mask = cache.attention_mask(slots, None) if cache is not None else None
        for i, layer in enumerate(self.decoder):
            layer_cache = cache.layers[i] if cache is not None else None
            x = layer(x, cos, sin, cross[i], cross_mask, cache=layer_cache, slots=slots, mask=mask)
        return self.logits(self.norm(x))

    # ------------------------------------------------------------ inference
    @torch.no_grad()
    def prefill(self, idx: Tensor, token_valid: Tensor, max_new_tokens: int) -> tuple[Tensor, EncDecState]:
        """Encode prompt[:-1] once; the decoder starts at the last prompt token (as in the PrefixLM phase)."""
        cross, cross_mask = self.encode(idx[:, :-1], token_valid[:, :-1])
        c, weight = self.config, self.embed.weight
        cache = DecoderCache(c.n_decoder_layer, idx.shape[0], c.n_kv_head, 1 + max_new_tokens, c.head_dim,
                             dtype=weight.dtype, device=weight.device)
        state = EncDecState(cache, cross, cross_mask, 0)
        return self.decode_step(state, idx[:, -1]), state

    @torch.no_grad()
    def decode_step(self, state: EncDecState, token: Tensor) -> Tensor:
        slots = torch.full((1,), state.next_slot, device=token.device)
        cos, sin = rope_angles(slots, self.config.rotary_dim, self.config.rope_base)
        logits = self._decode(token[:, None], cos, sin, state.cross, state.cross_mask, cache=state.cache, slots=slots)
        state.next_slot += 1
        return logits[:, -1]
