"""A paged KV cache: memory per request proportional to its own length, decode reading live keys only.

A static cache (:class:`~blockloop.nn.kv_cache.KVCache`) gives every row ``max_len`` slots, so the batch
that fits is set by the longest possible request, and a decode step over a dense ``(B, 1, 1, S)`` mask
reads ``rows x max_len`` keys whatever the rows' real lengths. Here each layer holds one pool of
``n_pages`` fixed-size pages ``(1, H_kv, n_pages * page_size, D)`` shared by every row, and
:class:`KVPages` keeps a page table per row: logical slot ``s`` of row ``b`` lives at pool position
``table[b, s // page_size] * page_size + s % page_size``. A row reserves pages as its request grows
(:meth:`KVPages.reserve` only ever adds pages) and gives them all back when the request finishes; they
are reused by the next.

Page 0 is a scratch page that belongs to nobody: every unreserved table entry points at it, so rows that
step past their reservation (idle slots, rows that finished inside an engine window) write there
harmlessly and no row ever reads it.

Three ways to read, same numbers (tests check each against the static cache):

* ``"pages"``: a decode step attends over the pool itself with a FlexAttention block mask built from the
  page table (:meth:`KVPages.pool_mask`): each row visits only its own live pages, so the bytes read
  per step are proportional to the sum of live lengths. The mask is made of device tensors updated in
  place, cheap enough to rebuild every step and capturable in a CUDA graph. The default on CUDA.
* ``"kernel"``: the same read of the pool by blockloop's Triton kernel (:mod:`blockloop.nn.paged_decode`): the
  step's mask is a :class:`PoolRead` (the page table, query slots and valid slots the kernel takes) rather than a
  block mask. CUDA only (or Triton's interpreter, for the tests); not the default until a GPU run shows it faster.
* ``"gather"``: every write returns the rows' logical ``(B, H_kv, S, D)`` views gathered from the pool,
  attended through the usual dense cache mask. The CPU reference, and what a prefill (many queries per
  row) always uses.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from blockloop.device import zeros_that_fit
from blockloop.errors import BlockloopError
from blockloop.nn.masks import decode_block_mask, sees_cached, visible_slots

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

READS = ("pages", "kernel", "gather")
SCRATCH = 0  # the page every unreserved table entry points at


class KVPages:
    """The page table of one paged cache: which pool pages each row owns, shared by all its layers.

    The free list lives on the host (reserving and releasing happen between engine windows, never inside
    a decode step); the table and each page's owner and logical index live on device for the step.
    """

    def __init__(
        self, n_rows: int, max_len: int, n_pages: int, page_size: int, *, device: torch.device | str, read: str | None = None
    ) -> None:
        if page_size < 1:
            raise BlockloopError(f"page_size must be at least 1, got {page_size}")
        width = -(-max_len // page_size)
        if n_pages < 2:
            raise BlockloopError(f"a paged cache needs at least 2 pages (one is scratch), got {n_pages}; give it more")
        cuda = torch.device(device).type == "cuda"
        read = read or ("pages" if cuda else "gather")
        if read not in READS:
            raise BlockloopError(f"unknown paged read {read!r}; choose one of {', '.join(READS)}")
        if read == "kernel" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise BlockloopError("the paged read 'kernel' is a Triton kernel: it runs on CUDA (on CPU only in Triton's "
                                 "interpreter, TRITON_INTERPRET=1); use read 'gather' on CPU")
        if cuda and read == "pages" and page_size % 16:
            # FlexAttention's CUDA kernels tile the keys of a block by at least 16.
            raise BlockloopError(f"on CUDA the page size must be a multiple of 16, got {page_size}")
        self.page_size, self.n_pages, self.max_len, self.read = page_size, n_pages, max_len, read
        self.limit = max_len  # the leading slots a step may read: its cache's (DecoderCache.limit_keys), for the gathers
        # the GPU's multiprocessors, for how the kernel read splits each row (asked here, never inside a step)
        self.processors = multiprocessors(torch.device(device)) if read == "kernel" and cuda else 0
        self.table = torch.full((n_rows, width), SCRATCH, dtype=torch.long, device=device)
        self.reserved = torch.zeros(n_rows, dtype=torch.long, device=device)  # pages held per row
        self.owner = torch.full((n_pages,), -1, dtype=torch.long, device=device)
        self.logical = torch.zeros(n_pages, dtype=torch.long, device=device)
        self.free: list[int] = list(range(n_pages - 1, SCRATCH, -1))
        self.held: dict[int, list[int]] = {}
        self.first_row = 0  # rows of a view are numbered from here in ``owner``

    @classmethod
    def for_tokens(
        cls, n_rows: int, max_len: int, tokens: int, page_size: int, *, device: torch.device | str, read: str | None = None
    ) -> KVPages:
        """Pages enough for ``tokens`` tokens (rounded up to whole pages), plus the scratch page."""
        return cls(n_rows, max_len, 1 + -(-tokens // page_size), page_size, device=device, read=read)

    @property
    def capacity(self) -> int:
        """Tokens the pool can hold in all (scratch page excluded)."""
        return (self.n_pages - 1) * self.page_size

    def pages_for(self, n_tokens: int) -> int:
        return -(-min(n_tokens, self.max_len) // self.page_size)

    def can_hold(self, token_counts: list[int], *, alone: bool = False) -> bool:
        """Whether new rows of these lengths can all reserve their pages now (``alone``: in an empty pool)."""
        return sum(map(self.pages_for, token_counts)) <= (self.n_pages - 1 if alone else len(self.free))

    def reserve(self, row: int, n_tokens: int) -> bool:
        """Make row ``row`` (of the whole table) hold the pages of its first ``n_tokens`` slots, adding to what
        it holds; False, changing nothing, when too few pages are free."""
        held = self.held.get(row, [])
        need = self.pages_for(n_tokens) - len(held)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        pages = [self.free.pop() for _ in range(need)]
        ids = torch.tensor(pages, dtype=torch.long, device=self.table.device)
        self.table[row, len(held) : len(held) + need] = ids
        self.owner[ids] = row
        self.logical[ids] = torch.arange(len(held), len(held) + need, device=ids.device)
        self.held[row] = held + pages
        self.reserved[row] = len(held) + need
        return True

    def reserve_all(self, rows: list[int], n_tokens: int) -> bool:
        """:meth:`reserve` for each of ``rows`` (one request's rows: a looped cache keeps one per loop), all or
        nothing."""
        need = sum(max(self.pages_for(n_tokens) - len(self.held.get(row, [])), 0) for row in rows)
        return need <= len(self.free) and all(self.reserve(row, n_tokens) for row in rows)

    def release(self, row: int) -> None:
        """Return row ``row``'s pages to the free list and point its table back at the scratch page."""
        pages = self.held.pop(row, [])
        if not pages:
            return
        ids = torch.tensor(pages, dtype=torch.long, device=self.table.device)
        self.owner[ids] = -1
        self.table[row] = SCRATCH
        self.reserved[row] = 0
        self.free.extend(reversed(pages))

    def rows(self, start: int, stop: int) -> KVPages:
        """Rows ``start .. stop - 1`` as a view: same pool pages and free list, the table's rows sliced."""
        view = KVPages.__new__(KVPages)  # attribute by attribute: a compiled step may take a view (dynamo traces it)
        view.page_size, view.n_pages, view.max_len, view.read = self.page_size, self.n_pages, self.max_len, self.read
        view.limit, view.processors = self.limit, self.processors
        view.owner, view.logical, view.free, view.held = self.owner, self.logical, self.free, self.held
        view.table, view.reserved, view.first_row = self.table[start:stop], self.reserved[start:stop], self.first_row + start
        return view

    def positions(self, slots: Tensor, rows: Tensor | None = None) -> Tensor:
        """Pool positions ``(B, T)`` of logical ``slots`` (``(T,)`` shared or ``(B, T)`` per row) of the table's
        rows, or of table rows ``rows (B,)`` (a looped cache: each batch row at its own loop's table row)."""
        table = self.table if rows is None else self.table[rows]
        slots = slots.expand(table.shape[0], -1) if slots.dim() == 1 else slots
        pages = table.gather(1, torch.div(slots, self.page_size, rounding_mode="floor"))
        return pages * self.page_size + slots % self.page_size

    @property
    def pooled(self) -> bool:
        """Whether decode steps attend over the pool itself (``"pages"``, ``"kernel"``) rather than gathered views."""
        return self.read != "gather"

    def reads_pool(self, slots: Tensor) -> bool:
        """Whether a step writing ``slots`` attends over the pool (a decode step under a pooled read) rather
        than over gathered logical views."""
        return self.pooled and slots.dim() == 2 and slots.shape[1] == 1

    def pool_mask(self, key_valid: Tensor, slots: Tensor, rows: Tensor | None = None, *, local: Tensor | None = None,
                  window: int = 0) -> BlockMask | PoolRead:
        """The mask of one decode query per row (``slots (B, 1)``) over the pool: row ``b`` visits its own
        reserved pages only (those of table row ``rows[b]`` when given), and within them sees what
        :func:`~blockloop.nn.masks.sees_cached` says (valid keys up to its slot, and itself); a row with
        ``local[b]`` only the slots less than ``window`` before its own, as the band of
        :func:`~blockloop.nn.masks.within_window` (a looped layer that is local at that row's loop).

        A FlexAttention block mask (``read="pages"``), or the same as the Triton kernel's inputs (``"kernel"``)."""
        if self.read == "kernel":
            table, reserved = (self.table, self.reserved) if rows is None else (self.table[rows], self.reserved[rows])
            return PoolRead(table, reserved, slots[:, 0], key_valid, self.page_size, local, window, self.processors)
        size = self.page_size
        owner, logical = self.owner, self.logical
        query, last = slots[:, 0], key_valid.shape[1] - 1
        rows = torch.arange(len(query), device=query.device) if rows is None else rows
        table_row = rows + self.first_row

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            page = kv_idx // size
            slot = logical[page] * size + kv_idx % size
            # A last page may run past the context (max_len not a multiple of the page size): those slots are
            # nobody's. Clamped for the lookup only, they would pass for the last slot, and for the query there.
            in_context = slot <= last
            slot = slot.clamp_max(last)
            seen = sees_cached(slot, query[b], key_valid[b, slot])
            if local is not None:
                seen = seen & (~local[b] | (slot > query[b] - window))
            return (owner[page] == table_row[b]) & in_context & seen

        return decode_block_mask(self.reserved[rows], self.table[rows], size, self.n_pages * size, mask_mod)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessor count, asked once per device and never inside a compiled step."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class PoolRead:
    """A decode step's read of a paged pool by the Triton kernel (``read="kernel"``), where FlexAttention gets a
    block mask: what :func:`~blockloop.nn.paged_decode.paged_decode_attention` takes besides the queries and pools.
    :func:`~blockloop.nn.attention.attention` sends a mask of this type to the kernel."""

    table: Tensor  # (B, W): each row's pages
    reserved: Tensor  # (B,): how many of them it holds (the rest point at the scratch page)
    query: Tensor  # (B,): each row's query slot
    key_valid: Tensor  # (B, S)
    page_size: int
    local: Tensor | None = None  # (B,): rows that see only their last ``window`` slots
    window: int = 0
    processors: int = 0  # the GPU's multiprocessors (0 off a GPU): how many programs keep it busy


class PagedKVCache(nn.Module):
    """One attention layer's pool of pages; the rows' page table is the shared :class:`KVPages`."""

    def __init__(self, pages: KVPages, n_kv_head: int, head_dim: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.pages = pages
        shape = (1, n_kv_head, pages.n_pages * pages.page_size, head_dim)
        device, fix = pages.table.device, "give the paged cache fewer tokens (--kv-tokens)"
        self.register_buffer("k", zeros_that_fit(shape, dtype, device, fix), persistent=False)
        self.register_buffer("v", zeros_that_fit(shape, dtype, device, fix), persistent=False)

    def write(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k, v (B, H_kv, T, D)`` at logical ``slots`` of the view's rows; return the pool (a decode
        step reading pages) or the rows' logical views to attend over."""
        pages = self.pages
        where = pages.positions(slots).flatten()
        for pool, new in ((self.k, k), (self.v, v)):
            # into the buffer itself: under inductor, writing a view (pool[0]) copied the whole pool every step
            pool.index_copy_(2, where, new.to(pool.dtype).transpose(0, 1).flatten(1, 2)[None])
        if pages.reads_pool(slots):
            return self.k, self.v
        return gather_rows(self.k, self.v, pages, slots=visible_slots(slots, pages.limit))

    def rows(self, start: int, stop: int) -> PagedKVCache:
        """Rows ``start .. stop - 1``: the same pool under a view of the page table."""
        view = PagedKVCache.__new__(PagedKVCache)
        nn.Module.__init__(view)
        view.pages = self.pages.rows(start, stop)
        view.register_buffer("k", self.k, persistent=False)
        view.register_buffer("v", self.v, persistent=False)
        return view


def gather_rows(k: Tensor, v: Tensor, pages: KVPages, rows: Tensor | None = None, *, slots: int | None = None
                ) -> tuple[Tensor, Tensor]:
    """Each row's logical view ``(B, H_kv, S, D)`` of its first ``slots`` slots (all ``max_len`` by default)
    gathered from pools ``k, v (1, H_kv, positions, D)``: the reference read (CPU), for a step whose mask is over
    logical slots. ``rows`` as in :meth:`KVPages.positions`. A step's mask covers no more slots than
    :func:`~blockloop.nn.masks.visible_slots` gives for its queries (under the cache's limit, :attr:`KVPages.limit`,
    on a compiled or CUDA step), so gathering more copies keys nobody reads: all ``max_len`` of each row, every
    layer and step, where a server's rows are the model's context long."""
    count = pages.max_len if slots is None else slots
    every = pages.positions(torch.arange(count, device=pages.table.device), rows)  # (B, count)
    return k[0][:, every].transpose(0, 1), v[0][:, every].transpose(0, 1)
