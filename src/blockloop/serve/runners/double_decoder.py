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

import torch
from torch import Tensor

from blockloop.errors import BlockloopError
from blockloop.models.double_decoder import ContextPrefix, DoubleDecoder
from blockloop.nn.kv_cache import StepContext
from blockloop.serve.runners.base import Runner
from blockloop.serve.runners.decoder import DecodeState
from blockloop.serve.runners.paging import PagedRows, Paging


class DoubleDecoderRunner(PagedRows, Runner):
    """``state``: the generation decoder's KV cache (each row's cross K/V, then its own), each row's next cache
    slot and position."""

    model: DoubleDecoder
    state: DecodeState

    def __init__(self, model: DoubleDecoder, prefix: ContextPrefix | None = None, paging: Paging | None = None) -> None:
        super().__init__(model)
        if prefix is not None and paging is not None:
            raise BlockloopError("a cached prefix is served in static batches, which keep a static cache; drop paging")
        self.paging = paging
        self.prefix = prefix
        self.per_slot = self.prefix_steps = prefix is None
        self.reserved = len(prefix) if prefix is not None else 0
        self.max_len = 0

    def allocate(self, n_slots: int, max_len: int) -> None:
        """The static cache for continuous batching; a static batch allocates its own in :meth:`prefill_batch`."""
        self.max_len = max_len
        if self.per_slot:
            self.state = self._state(n_slots, max_len, self.paging)

    def limit_keys(self, n_tokens: int) -> None:
        self.state.limit_keys(n_tokens)  # a slot per prompt token but the last (its cross K/V), then per new token

    def _state(self, rows: int, length: int, paging: Paging | None = None) -> DecodeState:
        device = self.model.embed.weight.device
        pages = None if paging is None else paging.pages(rows, length, device)
        cache = self.model.allocate_cache(self.model.config.n_generation_layer, rows, length, pages=pages)
        return DecodeState.of(cache, prefixes=self.prefix_steps)

    def _prefill(self, state: DecodeState, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Context pass over left-padded prompts into ``state``'s cache (all of its rows), then the last prompt
        token's generation step at the slot after the context."""
        positions = self.model.context_pass(idx, token_valid, state.cache, self.prefix)[:, -1:]
        slots = torch.full_like(positions, self.reserved + idx.shape[1] - 1)
        state.next_slot.copy_(slots[:, 0] + 1)
        state.next_position.copy_(positions[:, 0] + 1)
        return self.model.generation_step(idx[:, -1], StepContext(state.cache, slots, positions))

    @torch.no_grad()
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        self.state = self._state(idx.shape[0], self.reserved + self.max_len)
        return self._prefill(self.state, idx, token_valid)

    @torch.no_grad()
    def prefill_rows(self, start: int, prompts: Tensor) -> Tensor:
        """Prompts of one length into rows ``start ..`` of the cache in one context pass (views: the other rows
        keep their state)."""
        stop = start + prompts.shape[0]
        return self._prefill(self.state.rows(start, stop), prompts, torch.ones_like(prompts, dtype=torch.bool))

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        """One token per row; each row writes its own next slot (:meth:`DecodeState.step_slots`)."""
        step = StepContext(*self.state.step_slots(len(tokens), self.model.config.context_length))
        return self.model.generation_step(tokens, step)
