"""Serving the encoder-decoder baseline: encode prompt[:-1] once (every decoder layer's cross K/V), then
decode from the last prompt token with a KV cache for the decoder's self-attention only.

Continuous batching keeps cross K/V buffers of ``max_len`` entries per decoder layer and row, masked past
each row's encoded prompt; decoder positions count from 0 at each request's last prompt token. With
``paging`` (:mod:`blockloop.serve.runners.paging`) both the self-attention cache and the cross K/V live in
pages under one page table: a request holds the pages of its budget (prompt plus new tokens, which covers
its encoded prompt and its generated tokens alike) from admission and frees them when it finishes. A decode
step then reads the cross pool through a mask of the row's own pages ("pages", "kernel") or through gathered
logical views ("gather", the CPU reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from blockloop.models.decoder import CrossKV
from blockloop.models.encoder_decoder import EncoderDecoder
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.paged_cache import PagedKVCache, gather_rows
from blockloop.serve.runners.base import Runner, prefix_views
from blockloop.serve.runners.paging import PagedRows, Paging


@dataclass
class EncDecState:
    """The decoder's KV cache, every decoder layer's cross K/V and which cross keys are real, each row's next
    cache slot (which is also its decoder position). Paged, ``cross`` holds each layer's pool of pages."""

    cache: DecoderCache
    cross: list[CrossKV]
    cross_valid: Tensor  # (rows, cross length)
    next_slot: Tensor
    prefixes: dict[int, DecoderCache] = field(repr=False)  # the cache of a step over the first n rows (prefix_views)
    cross_limit: int | None = None  # how many leading cross keys a step reads (None: all; see Runner.limit_keys)


class EncoderDecoderRunner(PagedRows, Runner):
    model: EncoderDecoder
    state: EncDecState
    prefix_steps = True

    def __init__(self, model: EncoderDecoder, paging: Paging | None = None) -> None:
        super().__init__(model)
        self.paging = paging

    def allocate(self, n_slots: int, max_len: int) -> None:
        self.max_len = max_len
        c, weight = self.model.config, self.model.embed.weight
        pages = None if self.paging is None else self.paging.pages(n_slots, max_len, weight.device)
        if pages is None:
            shape = (n_slots, c.n_kv_head, max_len, c.head_dim)
            cross = [(weight.new_zeros(shape), weight.new_zeros(shape)) for _ in self.model.decoder]
        else:
            pools = [PagedKVCache(pages, c.n_kv_head, c.head_dim, dtype=weight.dtype) for _ in self.model.decoder]
            cross = [(pool.k, pool.v) for pool in pools]
        valid = torch.zeros(n_slots, max_len, dtype=torch.bool, device=weight.device)
        zeros = torch.zeros(n_slots, dtype=torch.long, device=weight.device)
        cache = self.model.allocate_cache(n_slots, max_len, pages=pages)
        self.state = EncDecState(cache, cross, valid, zeros, prefix_views(cache))

    def limit_keys(self, n_tokens: int) -> None:
        """A request of ``n_tokens`` tokens holds fewer encoded prompt tokens (its cross keys) and fewer decoder
        tokens (its self-attention cache) than that."""
        for cache in (self.state.cache, *self.state.prefixes.values()):
            cache.limit_keys(n_tokens)
        self.state.cross_limit = n_tokens

    @torch.no_grad()
    def prefill_rows(self, start: int, prompts: Tensor) -> Tensor:
        """Encode ``prompts[:, :-1] (n, P - 1)`` into rows ``start .. start + n - 1``'s cross K/V in one forward;
        decode their last tokens at slot 0."""
        state, pages = self.state, self.state.cache.pages
        n, rows = len(prompts), slice(start, start + len(prompts))
        cross, cross_mask = self.model.encode(prompts[:, :-1])
        length = cross_mask.shape[-1]
        for (k, v), (k1, v1) in zip(state.cross, cross):
            if pages is None:
                k[rows, :, :length], v[rows, :, :length] = k1, v1
            else:  # the pool (1, H, positions, D) at each row's pages, rows after one another
                at = pages.rows(start, start + n).positions(torch.arange(length, device=prompts.device)).reshape(-1)
                k[0, :, at], v[0, :, at] = (x.transpose(0, 1).reshape(x.shape[1], n * length, -1) for x in (k1, v1))
        state.cross_valid[rows] = False
        state.cross_valid[rows, :length] = cross_mask[:, 0, 0]
        cache = state.cache.rows(start, start + n)
        cache.reset()
        state.next_slot[rows] = 1
        step = StepContext(cache, torch.zeros(1, dtype=torch.long, device=prompts.device))
        cross_kv, mask = self._cross(rows)
        return self.model.decoder_step(prompts[:, -1], step, cross_kv, mask)

    @torch.no_grad()
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Encode the left-padded prompts but their last token; every row decodes from slot 0 of a (static) cache
        over the last prompt token and the generated ones."""
        cross, cross_mask = self.model.encode(idx[:, :-1], token_valid[:, :-1])
        cache = self.model.allocate_cache(idx.shape[0], 1 + self.max_len - idx.shape[1])
        start = torch.zeros(idx.shape[0], dtype=torch.long, device=idx.device)
        self.state = EncDecState(cache, cross, cross_mask[:, 0, 0], start, {idx.shape[0]: cache})
        return self.decode_step(idx[:, -1])

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        """One token per row of the first ``len(tokens)`` rows, at its own next slot (rows past the end of the
        cache rewrite their last one)."""
        state, rows = self.state, len(tokens)
        cache = state.prefixes[rows]
        slots = state.next_slot[:rows].clamp_max(cache.max_len - 1)[:, None]
        cross, mask = self._cross(slice(0, rows))
        logits = self.model.decoder_step(tokens, StepContext(cache, slots), cross, mask)
        state.next_slot = state.next_slot + 1
        return logits

    def _cross(self, rows: slice) -> tuple[list[CrossKV], object]:
        """The rows' cross K/V to attend over and their mask: the buffers and a dense key mask, or, paged, the
        pools with a block mask over each row's pages, or the rows' gathered logical views."""
        state, pages = self.state, self.state.cache.pages  # a lock-step batch's cache (and cross K/V) is static
        valid = state.cross_valid[rows]
        pages = pages.rows(rows.start, rows.stop) if pages is not None else None
        if pages is not None and pages.pooled:
            beyond = torch.full((len(valid), 1), valid.shape[1], device=valid.device)  # a query after every key
            return state.cross, pages.pool_mask(valid, beyond)
        valid = valid[:, : state.cross_limit]  # a mask narrower than the keys: attention reads the keys it covers only
        if pages is None:
            return [(k[rows], v[rows]) for k, v in state.cross], valid[:, None, None, :]
        return [gather_rows(k, v, pages, slots=valid.shape[1]) for k, v in state.cross], valid[:, None, None, :]
