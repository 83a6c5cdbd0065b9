"""Serving the block-based double decoder (section 3.3): the context decoder runs once per prompt (but its
last token), its latents become every generation layer's cross K/V, computed once; the last prompt token
opens the generation block, and only the generation layers keep a KV cache.

Continuous batching keeps static cross K/V buffers of ``max_len`` entries per generation layer (masked
past each row's prompt). Given a shared cached ``prefix`` (:meth:`DoubleDecoder.cache_prefix`), requests
are served in static batches continuing it (``per_slot = False``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from blockloop.models.decoder import CrossKV
from blockloop.models.double_decoder import ContextPrefix, DoubleDecoder
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.serve.runners.base import Runner


@dataclass
class DoubleDecodeState:
    """The generation decoder's own KV cache, the per-layer cross K/V (fixed), each row's next cache slot
    and position."""

    cache: DecoderCache
    cross: list[CrossKV]
    cross_mask: Tensor
    next_slot: Tensor
    next_position: Tensor


class DoubleDecoderRunner(Runner):
    model: DoubleDecoder
    state: DoubleDecodeState

    def __init__(self, model: DoubleDecoder, prefix: ContextPrefix | None = None) -> None:
        super().__init__(model)
        self.prefix = prefix
        self.per_slot = prefix is None
        self.reserved = len(prefix) if prefix is not None else 0
        self.max_len = 0

    def allocate(self, n_slots: int, max_len: int) -> None:
        """Static buffers for continuous batching; a static batch allocates its own in :meth:`prefill_batch`."""
        self.max_len = max_len
        if not self.per_slot:
            return
        model, c = self.model, self.model.config
        weight = model.embed.weight
        shape = (n_slots, c.n_kv_head, max_len, c.head_dim)
        cross = [(weight.new_zeros(shape), weight.new_zeros(shape)) for _ in model.generation]
        zeros = torch.zeros(n_slots, dtype=torch.long, device=weight.device)
        mask = torch.zeros(n_slots, 1, 1, max_len, dtype=torch.bool, device=weight.device)
        cache = model.allocate_cache(c.n_generation_layer, n_slots, max_len)
        self.state = DoubleDecodeState(cache, cross, mask, zeros, zeros.clone())

    def _prefill(self, idx: Tensor, token_valid: Tensor, generation_len: int) -> tuple[Tensor, DoubleDecodeState]:
        """Context pass over left-padded prompts, then the last prompt token's generation step."""
        cross, cross_mask, positions = self.model.context_pass(idx, token_valid, self.prefix)
        cache = self.model.allocate_cache(self.model.config.n_generation_layer, idx.shape[0], generation_len)
        state = DoubleDecodeState(cache, cross, cross_mask, torch.zeros_like(positions[:, -1]), positions[:, -1])
        return self._step(state, idx[:, -1]), state

    @torch.no_grad()
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        logits, self.state = self._prefill(idx, token_valid, 1 + self.max_len - idx.shape[1])
        return logits

    @torch.no_grad()
    def prefill_slot(self, slot: int, prompt: Tensor) -> Tensor:
        """The prefill of one prompt, copied into row ``slot``: its cross K/V and the generation cache entry
        of its last prompt token."""
        logits, one = self._prefill(prompt[None], torch.ones_like(prompt[None], dtype=torch.bool), 1)
        state = self.state
        length = one.cross_mask.shape[-1]
        for (k, v), (k1, v1) in zip(state.cross, one.cross):
            k[slot, :, :length], v[slot, :, :length] = k1[0], v1[0]
        state.cross_mask[slot] = False
        state.cross_mask[slot, ..., :length] = one.cross_mask[0]
        row, first = state.cache.row(slot), torch.zeros(1, dtype=torch.long, device=prompt.device)
        for layer, layer1 in zip(row.layers, one.cache.layers):
            layer.write(first, layer1.k, layer1.v)
        row.reset()
        row.mark(first)
        state.next_slot[slot], state.next_position[slot] = 1, one.next_position[0]
        return logits[0]

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        return self._step(self.state, tokens)

    def _step(self, state: DoubleDecodeState, tokens: Tensor) -> Tensor:
        """One token per row; each row writes its own next slot (rows past the end of the cache rewrite
        their last one)."""
        slots = state.next_slot.clamp_max(state.cache.max_len - 1)[:, None]
        step = StepContext(state.cache, slots, state.next_position[:, None])
        logits = self.model.generation_step(tokens, step, state.cross, state.cross_mask)
        state.next_slot = state.next_slot + 1
        state.next_position = state.next_position + 1
        return logits
