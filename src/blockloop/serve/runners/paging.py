"""Serving over a paged KV cache (:mod:`blockloop.nn.paged_cache`): the option a runner takes and the room
bookkeeping the engine calls, shared by every runner whose growing cache is one ``DecoderCache``.

A row holds pages for what its request has cached plus the coming window (the engine grows it window by
window through :meth:`Runner.reserve`) and frees them when the request finishes, so the batch that fits is
set by the tokens the running requests hold, not by ``n_slots x max_len``; on CUDA a decode step reads each
row's live pages only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockloop.errors import BlockloopError
from blockloop.nn.kv_cache import DecoderCache
from blockloop.nn.paged_cache import READS, KVPages


@dataclass(frozen=True)
class Paging:
    """A paged KV cache of ``tokens`` tokens in all (every layer), in pages of ``page_size``; ``read``:
    "pages" (decode reads live pages through FlexAttention; the CUDA default) or "gather" (the CPU default)."""

    tokens: int
    page_size: int = 128
    read: str | None = None

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.page_size < 1:
            raise BlockloopError(f"paging needs positive tokens and page_size, got {self.tokens} and {self.page_size}")
        if self.read is not None and self.read not in READS:
            raise BlockloopError(f"unknown paged read {self.read!r}; choose one of {', '.join(READS)}")

    def pages(self, n_slots: int, max_len: int, device: torch.device | str) -> KVPages:
        """The page table of a cache of ``n_slots`` rows of up to ``max_len`` tokens."""
        return KVPages.for_tokens(n_slots, max_len, self.tokens, self.page_size, device=device, read=self.read)


class PagedRows:
    """The engine's room calls for a runner whose ``state.cache`` may be paged (no-ops when it is static)."""

    state: object  # has ``cache: DecoderCache``

    @property
    def _pages(self) -> KVPages | None:
        cache: DecoderCache = self.state.cache  # type: ignore[attr-defined]
        return cache.pages

    def can_hold(self, token_counts: list[int], *, alone: bool = False) -> bool:
        return self._pages is None or self._pages.can_hold(token_counts, alone=alone)

    def reserve(self, slot: int, n_tokens: int) -> bool:
        return self._pages is None or self._pages.reserve(slot, n_tokens)

    def release(self, slot: int) -> None:
        if self._pages is not None:
            self._pages.release(slot)
