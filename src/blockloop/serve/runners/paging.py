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

DEFAULT_PAGE_SIZE = 128  # cache entries per page, unless asked otherwise (serve --page-size)


@dataclass(frozen=True)
class Paging:
    """A paged KV cache of ``tokens`` tokens in all (every layer), in pages of ``page_size``; ``read``:
    "pages" (decode reads live pages through FlexAttention; the CUDA default), "kernel" (the same through blockloop's
    Triton kernel, :mod:`blockloop.nn.paged_decode`) or "gather" (the CPU default)."""

    tokens: int
    page_size: int = DEFAULT_PAGE_SIZE
    read: str | None = None

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.page_size < 1:
            raise BlockloopError(f"paging needs positive tokens and page_size, got {self.tokens} and {self.page_size}")
        if self.read is not None and self.read not in READS:
            raise BlockloopError(f"unknown paged read {self.read!r}; choose one of {', '.join(READS)}")

    def pages(
        self, n_slots: int, max_len: int, device: torch.device | str, *, tokens_per_entry: int = 1, loops: int = 1
    ) -> KVPages:
        """The page table of a cache of ``n_slots`` rows of up to ``max_len`` entries, each entry standing for
        ``tokens_per_entry`` tokens (a Block Transformer's block decoder keeps one entry per block); a looped
        cache keeps ``loops`` table rows per slot (one per loop of its shared layers) in ``loops`` times the pool."""
        per_page = self.page_size * tokens_per_entry
        if self.tokens < per_page:
            entries = "" if tokens_per_entry == 1 else f": {self.page_size} entries of {tokens_per_entry} tokens"
            raise BlockloopError(f"a paged cache of {self.tokens} tokens (--kv-tokens) is less than one page of "
                                 f"{per_page} tokens{entries}; raise it or lower the page size (--page-size)")
        entries = -(-self.tokens // tokens_per_entry)
        per_loop = -(-entries // self.page_size) * self.page_size  # each loop's table row takes whole pages
        return KVPages.for_tokens(n_slots * loops, max_len, per_loop * loops, self.page_size, device=device,
                                  read=self.read)


class PagedRows:
    """The engine's room calls for a runner whose growing cache (``state.cache`` unless :attr:`_pages` says
    otherwise) may be paged (no-ops when it is static). The engine counts tokens; a cache entry may stand for
    ``tokens_per_entry`` of them, and a slot may own several rows of the page table (:meth:`_table_rows`)."""

    state: object  # has ``cache: DecoderCache``
    tokens_per_entry: int = 1

    @property
    def _pages(self) -> KVPages | None:
        cache: DecoderCache = self.state.cache  # type: ignore[attr-defined]
        return cache.pages

    def _table_rows(self, slot: int) -> list[int]:
        """The page-table rows of slot ``slot``'s request."""
        return [slot]

    def _entries(self, n_tokens: int) -> int:
        return -(-n_tokens // self.tokens_per_entry)

    def can_hold(self, token_counts: list[int], *, alone: bool = False) -> bool:
        copies = len(self._table_rows(0))
        return self._pages is None or self._pages.can_hold(
            [self._entries(n) for n in token_counts for _ in range(copies)], alone=alone)

    def kv_cache_usage(self) -> float | None:
        pages = self._pages
        return None if pages is None else 1 - len(pages.free) / (pages.n_pages - 1)

    def reserve(self, slot: int, n_tokens: int) -> bool:
        return self._pages is None or self._pages.reserve_all(self._table_rows(slot), self._entries(n_tokens))

    def release(self, slot: int) -> None:
        for row in self._table_rows(slot) if self._pages is not None else ():
            self._pages.release(row)
