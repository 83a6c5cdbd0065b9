"""Serving the encoder-decoder baseline: encode prompt[:-1] once (every decoder layer's cross K/V), then
decode from the last prompt token with a KV cache for the decoder's self-attention only.

Continuous batching keeps static cross K/V buffers of ``max_len`` entries per decoder layer, masked past
each row's encoded prompt; decoder positions count from 0 at each request's last prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from blockloop.models.decoder import CrossKV
from blockloop.models.encoder_decoder import EncoderDecoder
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.serve.runners.base import Runner


@dataclass
class EncDecState:
    """The decoder's KV cache, every decoder layer's cross K/V and key mask, each row's next cache slot
    (which is also its decoder position)."""

    cache: DecoderCache
    cross: list[CrossKV]
    cross_mask: Tensor
    next_slot: Tensor


class EncoderDecoderRunner(Runner):
    model: EncoderDecoder
    state: EncDecState

    def allocate(self, n_slots: int, max_len: int) -> None:
        self.max_len = max_len
        c, weight = self.model.config, self.model.embed.weight
        shape = (n_slots, c.n_kv_head, max_len, c.head_dim)
        cross = [(weight.new_zeros(shape), weight.new_zeros(shape)) for _ in self.model.decoder]
        mask = torch.zeros(n_slots, 1, 1, max_len, dtype=torch.bool, device=weight.device)
        zeros = torch.zeros(n_slots, dtype=torch.long, device=weight.device)
        self.state = EncDecState(self.model.allocate_cache(n_slots, max_len), cross, mask, zeros)

    @torch.no_grad()
    def prefill_slot(self, slot: int, prompt: Tensor) -> Tensor:
        """Encode ``prompt[:-1]`` into row ``slot``'s cross buffers; decode its last token at slot 0."""
        state = self.state
        cross, cross_mask = self.model.encode(prompt[None, :-1])
        length = cross_mask.shape[-1]
        for (k, v), (k1, v1) in zip(state.cross, cross):
            k[slot, :, :length], v[slot, :, :length] = k1[0], v1[0]
        state.cross_mask[slot] = False
        state.cross_mask[slot, ..., :length] = cross_mask[0]
        row = state.cache.row(slot)
        row.reset()
        state.next_slot[slot] = 1
        pick = slice(slot, slot + 1)
        step = StepContext(row, torch.zeros(1, dtype=torch.long, device=prompt.device))
        return self.model.decoder_step(prompt[-1:], step, [(k[pick], v[pick]) for k, v in state.cross],
                                       state.cross_mask[pick])[0]

    @torch.no_grad()
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Encode the left-padded prompts but their last token; every row decodes from slot 0 of a cache
        over the last prompt token and the generated ones."""
        cross, cross_mask = self.model.encode(idx[:, :-1], token_valid[:, :-1])
        cache = self.model.allocate_cache(idx.shape[0], 1 + self.max_len - idx.shape[1])
        self.state = EncDecState(cache, cross, cross_mask, torch.zeros(idx.shape[0], dtype=torch.long, device=idx.device))
        return self.decode_step(idx[:, -1])

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        """One token per row at its own next slot (rows past the end of the cache rewrite their last one)."""
        state = self.state
        slots = state.next_slot.clamp_max(state.cache.max_len - 1)[:, None]
        logits = self.model.decoder_step(tokens, StepContext(state.cache, slots), state.cross, state.cross_mask)
        state.next_slot = state.next_slot + 1
        return logits
