"""Sequence-wise serving of the single-stack families: the vanilla decoder, and the Ladder / Universal
Transformer / Transformer-XL and the Recursive Transformer run the same way.

The model needs two things: ``allocate_cache(batch_size, max_len)`` (one KV cache entry per layer
application) and a ``forward(idx, step=StepContext, last_only=True)`` that writes at the step's slots.
Rows advance independently, each at its own next cache slot and rotary position, so one state serves
a lock-step batch of left-padded prompts and a continuous batch of requests of different lengths.
With ``paging`` the cache is paged (:mod:`blockloop.serve.runners.paging`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from blockloop.errors import BlockloopError
from blockloop.models.decoder import LanguageModel
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.paged_cache import KVPages
from blockloop.serve.runners.base import Runner, prefix_views
from blockloop.serve.runners.paging import PagedRows, Paging


@dataclass
class DecodeState:
    """The cache, each row's next cache slot and next rotary position, and ``prefixes``: the cache of a step
    over the first ``n`` rows by ``n`` (the whole cache; with prefix steps, :attr:`Runner.prefix_steps`, also
    views of its first rows)."""

    cache: DecoderCache
    next_slot: Tensor
    next_position: Tensor
    prefixes: dict[int, DecoderCache] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, cache: DecoderCache, *, prefixes: bool = False) -> DecodeState:
        """A fresh state over ``cache``: every row at slot and position 0; with ``prefixes``, its
        :func:`prefix_views`."""
        zeros = torch.zeros(cache.batch_size, dtype=torch.long, device=cache.key_valid.device)
        return cls(cache, zeros, zeros.clone(), prefix_views(cache) if prefixes else {cache.batch_size: cache})

    def rows(self, start: int, stop: int) -> DecodeState:
        """Rows ``start .. stop - 1`` as a state whose cache and tensors are views of this one's (a prefill
        writes them in place)."""
        return DecodeState(self.cache.rows(start, stop), self.next_slot[start:stop], self.next_position[start:stop])

    def limit_keys(self, slots: int) -> None:
        """Steps over any of the cache's row counts read its first ``slots`` slots only
        (:meth:`DecoderCache.limit_keys`)."""
        for cache in (self.cache, *self.prefixes.values()):  # the full count's view is the cache: set twice, harmless
            cache.limit_keys(slots)

    def step_slots(self, rows: int, context_length: int | None) -> tuple[DecoderCache, Tensor, Tensor]:
        """The first ``rows`` rows' cache (from ``prefixes``) and the ``(rows, 1)`` slots and
        positions of their next token; then advance every row (the rows past ``rows`` are idle: a prefill sets
        a row's slots). Rebound, not updated in place: under CUDA graphs a plain tensor updated in place makes
        the graph fall back to eager, while a new one is the graph's output, the next replay's input. Rows past
        the end of the cache (idle or finished rows of a continuous batch that keep stepping) rewrite their last
        slot, at the model's last position (``context_length - 1``: a learned position table ends there; None for a
        model that streams past its context, whose positions are rotary)."""
        cache = self.prefixes[rows]
        slots = self.next_slot[:rows].clamp_max(self.cache.max_len - 1)[:, None]
        positions = self.next_position[:rows, None]
        if context_length is not None:
            positions = positions.clamp_max(context_length - 1)
        self.next_slot = self.next_slot + 1
        self.next_position = self.next_position + 1
        return cache, slots, positions


class DecoderRunner(PagedRows, Runner):
    """One KV cache over prompt and generated tokens; every forward writes one step's slots."""

    state: DecodeState
    chunked_prefill = resumable = prefix_steps = True

    def __init__(self, model: LanguageModel, paging: Paging | None = None) -> None:  # any single-stack model
        super().__init__(model)
        if paging is not None and model.streams:
            raise BlockloopError("this model keeps only the keys its queries see, a ring per layer (Transformer-XL's "
                                 "span), which pages cannot make smaller; serve it without paging (--kv-tokens)")
        self.paging = paging

    @property
    def streams(self) -> bool:
        """A model whose every cache entry is a ring (Transformer-XL's span) reads on past its context."""
        return self.model.streams

    def allocate(self, n_slots: int, max_len: int) -> None:
        device = self.model.embed.weight.device
        pages = None if self.paging is None else self._checked(self.paging.pages(n_slots, max_len, device))
        self.state = DecodeState.of(self._allocate_cache(n_slots, max_len, pages), prefixes=self.prefix_steps)

    def limit_keys(self, n_tokens: int) -> None:
        self.state.limit_keys(n_tokens)  # a slot per token

    def _checked(self, pages: KVPages) -> KVPages:
        """Refuse what a decode step reading pages cannot do: a relaxed model's learned prefix K/V sit in front
        of every row's keys (appendix K), which a mask over the shared pool cannot place."""
        if pages.pooled and getattr(self.model.config, "prefix_len", 0):
            raise BlockloopError("a model with a learned prefix (prefix_len) cannot read its paged cache through "
                                 "page masks; use Paging(..., read='gather') or serve it without paging")
        return pages

    def _allocate_cache(self, n_slots: int, max_len: int, pages: KVPages | None) -> DecoderCache:
        """The model's cache for the rows (a runner whose steps take slots back sizes rolling caches for it)."""
        return self.model.allocate_cache(n_slots, max_len, pages=pages)

    def prefill_rows(self, start: int, prompts: Tensor) -> Tensor:
        """Cache ``prompts (n, P)`` at slots 0..P-1 of rows ``start..start+n-1`` in one forward."""
        n, length = prompts.shape
        zeros = torch.zeros(n, dtype=torch.long, device=prompts.device)
        return self.prefill_chunk(start, prompts, zeros + length, zeros)

    @torch.no_grad()
    def prefill_chunk(self, start: int, chunks: Tensor, lengths: Tensor, offsets: Tensor) -> Tensor:
        """Row ``i``'s real tokens go to slots ``offsets[i] ..`` at the same rotary positions; its left padding
        is written *after* them (slots its later tokens overwrite), marked invalid, so every row's last
        real token is the chunk's last position and one forward serves prompts of any lengths."""
        n, width = chunks.shape
        cache = self.state.cache.rows(start, start + n)
        cache.reset(offsets == 0)  # a new request's row forgets the previous one
        pad = (width - lengths)[:, None]
        i = torch.arange(width, device=chunks.device)
        real = i >= pad
        slots = torch.where(real, offsets[:, None] + i - pad, offsets[:, None] + lengths[:, None] + i)
        slots = slots.clamp_max(cache.max_len - 1)
        logits, _ = self.model(chunks, step=StepContext(cache, slots, torch.where(real, slots, 0), real), last_only=True)
        self.state.next_slot[start : start + n] = self.state.next_position[start : start + n] = offsets + lengths
        return logits[:, -1]

    @torch.no_grad()
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Left-padded prompts at shared slots; rotary positions count from each row's first real token. A
        paged cache gives each row that holds no pages yet room for ``max_len`` tokens."""
        pages = self._pages
        for row in range(len(idx) if pages is not None else 0):
            if not self.reserve(row, pages.max_len):
                raise BlockloopError(f"a paged KV cache of {pages.capacity} tokens cannot hold {len(idx)} rows of "
                                     f"{pages.max_len}; give it more tokens or generate fewer rows at once")
        length = idx.shape[1]
        slots = torch.arange(length, device=idx.device)
        positions = (slots[None, :] - (~token_valid).sum(1, keepdim=True)).clamp_min(0)
        logits, _ = self.model(idx, step=StepContext(self.state.cache, slots, positions, token_valid), last_only=True)
        self.state.next_slot = torch.full_like(positions[:, -1], length)
        self.state.next_position = positions[:, -1] + 1
        return logits[:, -1]

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        """One token per row of the first ``len(tokens)`` rows, written at that row's own next slot. A row fed
        no token (-1: between two chunks of its prompt) writes a padding entry there, which no query sees and
        no ring keeps; its next chunk starts from where its prompt stopped."""
        context = None if self.streams else self.model.config.context_length
        cache, slots, positions = self.state.step_slots(len(tokens), context)
        step = StepContext(cache, slots, positions, (tokens >= 0)[:, None])
        logits, _ = self.model(tokens.clamp_min(0)[:, None], step=step)
        return logits[:, -1]
