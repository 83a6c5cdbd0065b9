"""The caches of depth-wise batching: a Recursive Transformer's shared layers hold keys/values per loop, and
in one decode step each row of the batch runs its own loop (:class:`~blockloop.serve.runners.recursive.RecursiveRunner`).

A step reads each row's loop where it lies, never copying it out: :class:`LoopedCache` keeps a shared layer's
loops one after another along the key axis of one buffer, and :class:`PagedLoopedCache` keeps them in pages of
one pool per shared layer, the page table holding one row per slot and loop. Both give the runner the same
calls: :meth:`~LoopedCache.loop_layer` (the layer with row ``b`` at loop ``loop[b]``), :meth:`~LoopedCache.lift`
(the step's masks for that layout) and :meth:`~LoopedCache.copy_exits` (an early-exited token's K/V copied into
the deeper loops it skipped). Depth entry ``loop * n_layer + j`` of ``layers`` is loop ``loop`` of shared layer
``j`` as an ordinary cache, for the sequence-wise prefill.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockloop.device import zeros_that_fit
from blockloop.errors import BlockloopError
from blockloop.models.decoder import LayerInputs
from blockloop.nn.kv_cache import CACHE_FIX, DecoderCache, KVCache, RollingKVCache
from blockloop.nn.masks import decode_block_mask, sees_cached, visible_slots
from blockloop.nn.paged_cache import KVPages, PagedKVCache, gather_rows

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

LOOP_READS = ("dense", "blocks")
BLOCK = 128  # keys per block of the "blocks" read (FlexAttention's CUDA kernels tile by at least 16)


class RowLoopKV:
    """One shared layer's keys/values when each row of the batch runs its own loop (depth-wise batching).

    ``k, v`` are ``(B, H_kv, loops * span, D)``: loop ``l`` of row ``b`` is ``[b, :, l * span : (l + 1) * span]``.
    Row ``b`` writes its token into loop ``loop[b]``'s part, and the step attends over the stacked rows as they
    are, with a mask that shows each row only its own loop's part (:meth:`LoopedCache.lift`): no row's loop is
    copied out to attend over. A ``rolling`` layer's ``span`` is its ring (and scratch entry); it is attended
    as the ring before the write then the new key, as :class:`~blockloop.nn.kv_cache.RollingKVCache` does, so
    its rows' rings (window-sized) are gathered.
    """

    def __init__(self, k: Tensor, v: Tensor, loop: Tensor, span: int, rolling: bool = False) -> None:
        self.k, self.v, self.loop, self.span, self.rolling = k, v, loop, span, rolling

    def write(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store one token per row, ``k, v (B, H_kv, 1, D)`` at per-row ``slots (B, 1)`` of its loop (a rolling
        layer's ring entries, :meth:`~blockloop.nn.kv_cache.DecoderCache.ring_entries`)."""
        rows = torch.arange(k.shape[0], device=k.device)
        before = tuple(self._rings(t, rows) for t in (self.k, self.v)) if self.rolling else None
        at = self.loop * self.span + slots[:, 0]
        self.k[rows, :, at] = k[:, :, 0].to(self.k.dtype)
        self.v[rows, :, at] = v[:, :, 0].to(self.v.dtype)
        if before is not None:
            return torch.cat((before[0], k.to(self.k.dtype)), 2), torch.cat((before[1], v.to(self.v.dtype)), 2)
        return self.k, self.v

    def _rings(self, stacked: Tensor, rows: Tensor) -> Tensor:
        """Each row's ring at its own loop, ``(B, H_kv, span, D)``."""
        b, h, _, d = stacked.shape
        return stacked.view(b, h, -1, self.span, d)[rows, :, self.loop]


class LoopedCache(DecoderCache):
    """A cache for ``n_layer`` shared layers run ``loops`` times. Shared layer ``j`` keeps ``(B, H_kv, loops *
    span, D)`` buffers, loop after loop along the key axis, and depth entry ``loop * n_layer + j`` is a view of
    one loop's part: one batch can run every row at the same loop (``layers``, the sequence-wise prefill) or
    each row at its own (:meth:`loop_layer` with the masks of :meth:`lift`). Shared layers in ``rolling``
    (local at every loop) stack rings of ``window`` slots.

    ``read`` is how a depth-wise step shows each row its own loop: ``"dense"`` (a boolean mask over every
    loop's keys, False outside the row's loop: no copy, but the kernel scans all loops; the CPU default) or
    ``"blocks"`` (a FlexAttention block mask that visits only the row's live blocks of its loop, so a step
    reads what a row has cached at that loop and nothing else; the CUDA default; each loop's span is then a
    whole number of 128-key blocks).
    """

    def __init__(
        self, n_layer: int, loops: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int, *,
        dtype: torch.dtype, device: torch.device | str, rolling: Collection[int] = (), window: int = 0,
        read: str | None = None,
    ) -> None:
        entries = [loop * n_layer + j for loop in range(loops) for j in rolling]
        super().__init__(0, batch_size, n_kv_head, max_len, head_dim, dtype=dtype, device=device,
                         rolling=entries, window=window)
        read = read or ("blocks" if torch.device(device).type == "cuda" else "dense")
        if read not in LOOP_READS:
            raise BlockloopError(f"unknown looped-cache read {read!r}; choose one of {', '.join(LOOP_READS)}")
        if read == "blocks" and rolling:
            raise BlockloopError("the 'blocks' read of a looped cache has no rolling (sliding-window) layers; use 'dense'")
        self.loops, self.read, self.rolling_layers = loops, read, frozenset(rolling)
        self.span = -(-max_len // BLOCK) * BLOCK if read == "blocks" else max_len
        ring = self.ring_slot.shape[1]  # ring entries + the scratch one
        self.spans = [ring if j in self.rolling_layers else self.span for j in range(n_layer)]
        self.stacked = [
            stacked_rings(self, loops, n_kv_head, head_dim, dtype, device) if j in self.rolling_layers else
            tuple(zeros_that_fit((batch_size, n_kv_head, loops * self.span, head_dim), dtype, device, CACHE_FIX) for _ in "kv")
            for j in range(n_layer)
        ]
        self.layers = nn.ModuleList(
            (RollingKVCache if j in self.rolling_layers else KVCache).of(
                *(t[:, :, loop * self.spans[j] :][:, :, : self.spans[j] if j in self.rolling_layers else max_len]
                  for t in self.stacked[j]))
            for loop in range(loops) for j in range(n_layer)
        )

    def rows(self, start: int, stop: int) -> LoopedCache:
        """Rows ``start .. stop - 1``, every loop of them, over views of this cache's buffers (a prefill; a
        depth-wise step over the busy first rows)."""
        view = super().rows(start, stop)
        view.loops, view.read, view.rolling_layers = self.loops, self.read, self.rolling_layers
        view.span, view.spans = self.span, self.spans
        view.stacked = [tuple(t[start:stop] for t in stack) for stack in self.stacked]
        return view

    def loop_layer(self, layer: int, loop: Tensor) -> RowLoopKV:
        """Shared layer ``layer`` with row ``b`` at loop ``loop[b]``."""
        return RowLoopKV(*self.stacked[layer], loop, self.spans[layer], layer in self.rolling_layers)

    def lift(self, inputs: LayerInputs, loop: Tensor, slots: Tensor) -> LayerInputs:
        """A depth-wise step's masks for the full-length layers, moved from one loop's slots onto the stacked
        buffers: row ``b`` sees, at loop ``loop[b]``'s part, what the step's cache mask shows it (queries at
        ``slots (B, 1)``), and nothing of its other loops. Rolling layers' ring masks stay as they are."""
        if self.read == "blocks":
            return replace(inputs, masks={"mask": self._block_mask(loop, slots)})
        at_loop = (loop[:, None] == torch.arange(self.loops, device=loop.device))[:, None, None, :, None]

        def lifted(masks: dict[str, object] | None) -> dict[str, object] | None:
            if masks is None:
                return None
            mask = masks["mask"]  # over the slots up to the furthest query's (DecoderCache.visible): each loop has span
            mask = F.pad(mask, (0, self.span - mask.shape[-1])) if mask.shape[-1] < self.span else mask
            return {"mask": (at_loop & mask.unsqueeze(-2)).flatten(-2)}

        return replace(inputs, masks=lifted(inputs.masks), local_masks=lifted(inputs.local_masks))

    def _block_mask(self, loop: Tensor, slots: Tensor) -> BlockMask:
        """Row ``b`` visits the blocks of loop ``loop[b]`` up to its query's slot, and sees in them what
        :func:`~blockloop.nn.masks.sees_cached` says."""
        span, key_valid, query = self.span, self.key_valid, slots[:, 0]
        last = key_valid.shape[1] - 1

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            slot = kv_idx - loop[b] * span
            at = slot.clamp(0, last)
            seen = sees_cached(at, query[b], key_valid[b, at])
            return (slot >= 0) & (slot <= last) & seen

        width = span // BLOCK
        counts = torch.div(query, BLOCK, rounding_mode="floor") + 1
        indices = loop[:, None] * width + torch.arange(width, device=loop.device)
        return decode_block_mask(counts, indices, BLOCK, self.loops * span, mask_mod)

    def copy_exits(self, exited: Tensor, loop: Tensor, slot: Tensor) -> None:
        """Rows where ``exited (B,)``: copy the K/V their token wrote at loop ``loop[b]`` (slot ``slot[b]``) into
        every deeper loop's entry."""
        ring_entry = self.ring_entries(slot[:, None])[:, 0] if self.rolling else slot
        for j, stack in enumerate(self.stacked):
            entry = ring_entry if j in self.rolling_layers else slot
            copy_stacked_exits(stack, self.spans[j], entry, exited, loop)


def copy_stacked_exits(stack: tuple[Tensor, Tensor], span: int, entry: Tensor, exited: Tensor, loop: Tensor) -> None:
    """In one layer's loops stacked along the key axis (``span`` entries each): rows where ``exited`` copy the
    K/V of their entry ``entry[b]`` at loop ``loop[b]`` into the same entry of every deeper loop."""
    rows = torch.arange(loop.shape[0], device=loop.device)
    loops = stack[0].shape[2] // span
    for buffer in stack:
        exit_kv = buffer[rows, :, loop * span + entry]
        for deeper in range(1, loops):
            owed = (exited & (loop < deeper))[:, None, None]
            at = deeper * span + entry
            buffer[rows, :, at] = torch.where(owed, exit_kv, buffer[rows, :, at])


def stacked_rings(cache: DecoderCache, loops: int, n_kv_head: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device | str) -> tuple[Tensor, Tensor]:
    """A rolling layer's rings of every loop, loop after loop along the key axis: ``(B, H_kv, loops * ring, D)``
    (``cache.ring_slot`` says how many entries a ring has, its scratch entry included)."""
    ring = cache.ring_slot.shape[1]
    return tuple(zeros_that_fit((cache.batch_size, n_kv_head, loops * ring, head_dim), dtype, device, CACHE_FIX)
                 for _ in "kv")


class PagedRowLoopKV:
    """:class:`RowLoopKV` over a pool of pages: row ``b`` at loop ``loop[b]`` is row ``loop[b] * B + b`` of the
    page table. Reading pages, a step attends over the pool itself (the block mask of :meth:`PagedLoopedCache.lift`
    visits the row's pages of its loop only); reading by gathering (the CPU reference), over each row's loop
    gathered into a logical ``(B, H_kv, S, D)`` view."""

    def __init__(self, pool: PagedKVCache, table_rows: Tensor, pages: KVPages) -> None:
        self.k, self.v, self.pages, self.table_rows = pool.k, pool.v, pages, table_rows

    def write(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store one token per row, ``k, v (B, H_kv, 1, D)`` at per-row ``slots (B, 1)`` of its loop."""
        pages = self.pages
        at = pages.positions(slots, self.table_rows)[:, 0]
        self.k[0][:, at] = k[:, :, 0].transpose(0, 1).to(self.k.dtype)
        self.v[0][:, at] = v[:, :, 0].transpose(0, 1).to(self.v.dtype)
        if pages.pooled:
            return self.k, self.v
        return gather_rows(self.k, self.v, pages, self.table_rows, slots=visible_slots(slots, pages.limit))


class PagedLoopedCache(DecoderCache):
    """:class:`LoopedCache` in pages: each full-length shared layer ``j`` keeps one pool, and ``loop_pages`` (a
    :class:`KVPages` of ``loops * batch_size`` rows) gives slot ``b``'s loop ``l`` table row ``l * batch_size + b``,
    so a request holds pages for what it has cached at each loop (a view of rows ``start ..`` keeps the whole
    table: its row ``b`` is slot ``start + b``). The depth-wise step reads the pools as
    ``loop_pages.read`` says (``"pages"``, ``"kernel"``: a mask over each row's own loop's pages; ``"gather"``: gathered
    logical views); the sequence-wise prefill, through ``layers``, always gathers. Shared layers in ``rolling``
    (local at every loop) keep their window-sized rings stacked per loop, as in :class:`LoopedCache`: they hold
    no pages."""

    def __init__(
        self, n_layer: int, loops: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int, *,
        dtype: torch.dtype, pages: KVPages, rolling: Collection[int] = (), window: int = 0,
    ) -> None:
        device = pages.table.device
        entries = [loop * n_layer + j for loop in range(loops) for j in rolling]
        super().__init__(0, batch_size, n_kv_head, max_len, head_dim, dtype=dtype, device=device, rolling=entries,
                         window=window)
        if (pages.table.shape[0], pages.max_len) != (loops * batch_size, max_len):
            raise ValueError(f"a looped cache of {loops} loops x {batch_size} rows x {max_len} slots needs a page "
                             f"table of {loops * batch_size} rows for max_len {max_len}")
        self.loops, self.loop_pages, self.rolling_layers = loops, pages, frozenset(rolling)
        self.rows_per_loop, self.first_slot = batch_size, 0  # page-table rows per loop; the first slot here
        self.ring = self.ring_slot.shape[1]
        self.stores = [stacked_rings(self, loops, n_kv_head, head_dim, dtype, device) if j in self.rolling_layers
                       else PagedKVCache(pages, n_kv_head, head_dim, dtype=dtype) for j in range(n_layer)]

        def loop_view(j: int, loop: int) -> PagedKVCache | RollingKVCache:
            if j in self.rolling_layers:
                return RollingKVCache.of(*(t[:, :, loop * self.ring : (loop + 1) * self.ring] for t in self.stores[j]))
            view = self.stores[j].rows(loop * batch_size, (loop + 1) * batch_size)
            view.pages.read = "gather"  # a sequence-wise step's mask is over logical slots
            return view

        self.layers = nn.ModuleList(loop_view(j, loop) for loop in range(loops) for j in range(n_layer))

    def rows(self, start: int, stop: int) -> PagedLoopedCache:
        """Rows ``start .. stop - 1``, every loop of them: the same pools and page table, the rings' rows sliced (a
        prefill; a depth-wise step over the busy first rows)."""
        view = super().rows(start, stop)
        view.loops, view.loop_pages, view.rolling_layers, view.ring = self.loops, self.loop_pages, self.rolling_layers, self.ring
        view.rows_per_loop, view.first_slot = self.rows_per_loop, self.first_slot + start
        view.stores = [tuple(t[start:stop] for t in store) if j in self.rolling_layers else store
                       for j, store in enumerate(self.stores)]
        return view

    def limit_keys(self, slots: int) -> None:
        super().limit_keys(slots)
        self.loop_pages.limit = self.limit  # the depth-wise step's gathered read

    def loop_layer(self, layer: int, loop: Tensor) -> PagedRowLoopKV | RowLoopKV:
        """Shared layer ``layer`` with row ``b`` at loop ``loop[b]``."""
        if layer in self.rolling_layers:
            return RowLoopKV(*self.stores[layer], loop, self.ring, rolling=True)
        return PagedRowLoopKV(self.stores[layer], self.table_rows(loop), self.loop_pages)

    def table_rows(self, loop: Tensor) -> Tensor:
        """The page-table row of each batch row ``b`` at loop ``loop[b]``: ``loop[b] * rows_per_loop + first_slot + b``."""
        return loop * self.rows_per_loop + self.first_slot + torch.arange(len(loop), device=loop.device)

    def lift(self, inputs: LayerInputs, loop: Tensor, slots: Tensor) -> LayerInputs:
        """The step's mask over the pool (reading pages), or as it is (gathered logical views); rolling layers'
        ring masks stay as they are. Over the pool, a layer local at some loops only gets a block mask with a
        window band for the rows at its local loops."""
        if not self.loop_pages.pooled:
            return inputs
        rows = self.table_rows(loop)

        def per_row_masks(local: Tensor) -> dict[str, object]:
            return {"mask": self.loop_pages.pool_mask(self.key_valid, slots, rows, local=local, window=self.window)}

        return replace(inputs, masks={"mask": self.loop_pages.pool_mask(self.key_valid, slots, rows)},
                       per_row_masks=per_row_masks)

    def copy_exits(self, exited: Tensor, loop: Tensor, slot: Tensor) -> None:
        """As :meth:`LoopedCache.copy_exits`, between the rows' pages of each loop (and rings of each loop)."""
        position = lambda at_loop: self.loop_pages.positions(slot[:, None], self.table_rows(at_loop))[:, 0]  # noqa: E731
        source = position(loop)
        targets = [position(torch.full_like(loop, deeper)) for deeper in range(1, self.loops)]
        ring_entry = self.ring_entries(slot[:, None])[:, 0] if self.rolling else None
        for store in self.stores:
            if not isinstance(store, PagedKVCache):
                copy_stacked_exits(store, self.ring, ring_entry, exited, loop)
                continue
            for deeper, target in enumerate(targets, start=1):
                owed = (exited & (loop < deeper))[None, :, None]
                for buffer in (store.k[0], store.v[0]):
                    buffer[:, target] = torch.where(owed, buffer[:, source], buffer[:, target])
