"""Serving the block-based double decoder (section 3.3): the context decoder runs once per prompt (but its
last token), its latents become every generation layer's cross K/V, computed once; the last prompt token
opens the generation block, and only the generation layers keep a KV cache.

One buffer per generation layer holds both key sets a token attends to: a row whose prompt has ``C + 1``
tokens has its cross K/V at slots ``0 .. C-1`` and its generated tokens' own K/V from slot ``C`` on, so a
decode step is one attention over the cache with the cache's own mask (valid context positions, written
generation slots), exactly a decoder's step, and the buffer of a slot of ``max_len`` tokens is ``max_len``
entries, what the request can hold (prompt + new tokens). Continuous batching prefills requests into rows of
that cache; given a shared cached ``prefix`` (:meth:`DoubleDecoder.cache_prefix`), requests are served in
static batches continuing it (``per_slot = False``), whose cache puts the prefix's cross K/V first. Under
continuous batching the cache may be paged (``paging``, :mod:`blockloop.serve.runners.paging`): a row's cross
K/V and its generated tokens' then take pages as its request grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from blockloop.errors import BlockloopError
from blockloop.models.double_decoder import ContextPrefix, DoubleDecoder
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.serve.runners.base import Runner
from blockloop.serve.runners.paging import PagedRows, Paging


@dataclass
class DoubleDecodeState:
    """The generation decoder's KV cache (each row's cross K/V, then its own), each row's next cache slot
    and position."""

    cache: DecoderCache
    next_slot: Tensor
    next_position: Tensor


class DoubleDecoderRunner(PagedRows, Runner):
    model: DoubleDecoder
    state: DoubleDecodeState

    def __init__(self, model: DoubleDecoder, prefix: ContextPrefix | None = None, paging: Paging | None = None) -> None:
        super().__init__(model)
        if prefix is not None and paging is not None:
            raise BlockloopError("a cached prefix is served in static batches, which keep a static cache; drop paging")
        self.paging = paging
        self.prefix = prefix
        self.per_slot = prefix is None
        self.reserved = len(prefix) if prefix is not None else 0
        self.max_len = 0

    def allocate(self, n_slots: int, max_len: int) -> None:
        """The static cache for continuous batching; a static batch allocates its own in :meth:`prefill_batch`."""
        self.max_len = max_len
        if self.per_slot:
            self.state = self._state(n_slots, max_len, self.paging)

    def _state(self, rows: int, length: int, paging: Paging | None = None) -> DoubleDecodeState:
        device = self.model.embed.weight.device
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        pages = None if paging is None else paging.pages(rows, length, device)
        cache = self.model.allocate_cache(self.model.config.n_generation_layer, rows, length, pages=pages)
        return DoubleDecodeState(cache, zeros, zeros.clone())

    def _prefill(self, state: DoubleDecodeState, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Context pass over left-padded prompts into ``state``'s cache (all of its rows), then the last prompt
        token's generation step at the slot after the context."""
        positions = self.model.context_pass(idx, token_valid, state.cache, self.prefix)
        state.next_slot.fill_(self.reserved + idx.shape[1] - 1)
        state.next_position.copy_(positions[:, -1])
        return self._step(state, idx[:, -1])

    @torch.no_grad()
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        self.state = self._state(idx.shape[0], self.reserved + self.max_len)
        return self._prefill(self.state, idx, token_valid)

    @torch.no_grad()
    def prefill_rows(self, start: int, prompts: Tensor) -> Tensor:
        """Prompts of one length into rows ``start ..`` of the cache in one context pass (views: the other rows
        keep their state)."""
        stop = start + prompts.shape[0]
        state = self.state
        rows = DoubleDecodeState(state.cache.rows(start, stop), state.next_slot[start:stop], state.next_position[start:stop])
        return self._prefill(rows, prompts, torch.ones_like(prompts, dtype=torch.bool))

    @torch.no_grad()
    def prefill_slot(self, slot: int, prompt: Tensor) -> Tensor:
        return self.prefill_rows(slot, prompt[None])[0]

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        return self._step(self.state, tokens)

    def _step(self, state: DoubleDecodeState, tokens: Tensor) -> Tensor:
        """One token per row; each row writes its own next slot (rows past the end of the cache rewrite
        their last one)."""
        slots = state.next_slot.clamp_max(state.cache.max_len - 1)[:, None]
        step = StepContext(state.cache, slots, state.next_position[:, None])
        logits = self.model.generation_step(tokens, step)
        state.next_slot += 1
        state.next_position += 1
        return logits
