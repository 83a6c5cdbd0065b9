"""Static key/value caches: preallocated once, written in place at explicit slots.

Growing a cache with ``torch.cat`` reallocates and copies it every step and changes shapes, which
defeats CUDA graphs and ``torch.compile``. Here each layer owns fixed ``(B, H_kv, S, D)`` buffers and a
step writes its keys/values in place at slot indices: either slots shared by every row ``(T,)`` (a
lock-step batch) or each row's own slots ``(B, T)`` (continuous batching, where every row of the batch is
a different request at its own length). Which slots hold a real token (not left padding, not yet
written) is tracked once per model in :class:`DecoderCache`; :meth:`DecoderCache.rows` is a view of some
rows, so requests can be prefilled into their slots while the other rows keep their state.

One way in: keys/values enter a cache only through :meth:`KVCache.write`, and slots become visible only
through :meth:`DecoderCache.mark`; building a mask (:meth:`DecoderCache.mask`) reads, never writes. A
cached forward gets one :class:`StepContext` (the cache, the slots it writes, the tokens' positions and
validity) instead of those four things one by one.

Sliding-window layers keep a rolling cache (:class:`RollingKVCache`): a ring of ``window + rollback`` entries
per row (at most ``max_len``, plus one scratch entry) instead of ``max_len`` slots, so their memory is
O(window) whatever the context. A step's keys are attended as the ring *before* the step plus the step's own
keys (so a prefill of any length attends exactly with every prompt key it computed), and only the row's newest
real tokens are stored, slot ``s`` at entry ``s % ring`` (:meth:`DecoderCache.ring_entries`; padding and a long
step's older tokens go to the scratch entry). :class:`DecoderCache` records which slot each ring entry holds
(``ring_slot``), once for all its rolling layers; :meth:`DecoderCache.rolling_mask` turns it into the exact
window mask.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from blockloop.device import zeros_that_fit
from blockloop.nn.masks import cache_mask, ring_mask, visible_slots
from blockloop.nn.paged_cache import KVPages, PagedKVCache

CACHE_FIX = "serve fewer slots (--slots) or shorter ones (--max-len), or hold the cache in pages (--kv-tokens)"


class KVCache(nn.Module):
    """One attention layer's keys and values for ``batch_size`` rows and ``max_len`` slots."""

    def __init__(
        self, batch_size: int, n_kv_head: int, max_len: int, head_dim: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.register_buffer("k", zeros_that_fit(shape, dtype, device, CACHE_FIX), persistent=False)
        self.register_buffer("v", zeros_that_fit(shape, dtype, device, CACHE_FIX), persistent=False)

    def write(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k, v (B, H_kv, T, D)`` at ``slots`` (``(T,)`` shared, or ``(B, T)`` per row) and return
        the whole cache to attend over."""
        if slots.dim() == 1:
            self.k.index_copy_(2, slots, k.to(self.k.dtype))
            self.v.index_copy_(2, slots, v.to(self.v.dtype))
        else:  # not scatter_: inductor copies a scattered buffer whole (twice for V) on every compiled step
            rows = torch.arange(slots.shape[0], device=slots.device)[:, None]
            self.k[rows, :, slots] = k.transpose(1, 2).to(self.k.dtype)
            self.v[rows, :, slots] = v.transpose(1, 2).to(self.v.dtype)
        return self.k, self.v

    @classmethod
    def of(cls, k: Tensor, v: Tensor) -> KVCache:
        """A cache over existing ``(B, H_kv, S, D)`` buffers (views): writing it writes them."""
        view = cls.__new__(cls)
        nn.Module.__init__(view)
        view.register_buffer("k", k, persistent=False)
        view.register_buffer("v", v, persistent=False)
        return view

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows ``start .. stop - 1`` as a batch whose buffers are views: writing it writes this cache."""
        return type(self).of(self.k[start:stop], self.v[start:stop])


class RollingKVCache(KVCache):
    """A sliding-window layer's keys and values: a ring of ``ring`` entries per row, slot ``s`` at entry
    ``s % ring``, and one scratch entry after them that no mask ever shows.

    :meth:`write` takes *ring entries* (:meth:`DecoderCache.ring_entries`, which :meth:`StepContext.layer` hands
    rolling layers) and returns the ring as it was *before* this step, followed by the step's own keys/values
    ``(B, H_kv, ring + 1 + T, D)``. So a prefill of ``T`` tokens (``T`` larger than the ring) attends with all
    ``T`` keys it computed and keeps only the ones later tokens can still see; the ring never needs room for a
    whole prompt, and padding (left, or written after a row's real tokens in a mixed-length chunk) never
    displaces a real key. The mask that goes with it is :meth:`DecoderCache.rolling_mask` (ring entries first,
    then the step's keys). Why ``window + rollback`` entries: the cache's bookkeeping marks a step's slots once
    for every rolling layer, and in a depth-wise step (a row's token runs one loop per step) or a speculative
    round (draft loops run before the verifying ones) a layer's ring may lag its marks by the step's slots;
    ``window`` entries keep every slot a query still sees, and the ``rollback`` extra entries the slots before a
    ``rollback + 1``-token verification, whose rejected drafts later steps overwrite.
    """

    @property
    def ring(self) -> int:
        return self.k.shape[2] - 1

    def write(self, entries: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k, v (B, H_kv, T, D)`` at ring ``entries`` (``(T,)`` shared or ``(B, T)`` per row) and return the
        ring before the write followed by ``k, v``."""
        keys, values = torch.cat((self.k, k.to(self.k.dtype)), 2), torch.cat((self.v, v.to(self.v.dtype)), 2)
        super().write(entries, k, v)
        return keys, values


class DecoderCache(nn.Module):
    """Per-layer KV caches plus which slots of each row hold a real token.

    Rows are independent: a row's keys are only visible to that row, and only where ``key_valid`` is
    set, so left-padded prompts of different lengths share one set of slot indices. With ``pages`` the
    layers keep their keys in pages of one shared pool instead (:mod:`blockloop.nn.paged_cache`): the
    same slots and masks, memory per row only for the pages it reserved (rolling layers keep their rings:
    they are window-sized already).

    Layers in ``rolling`` (sliding-window layers seeing the last ``window`` slots) get a
    :class:`RollingKVCache` of ``min(window + rollback, max_len)`` entries (and a scratch one); ``rollback`` is
    how many slots a step may write past what a row keeps (a speculative round's ``k`` drafts).
    ``ring_slot (B, ring + 1)`` is the slot each ring entry last recorded (-1: none, always for the scratch
    entry), shared by every rolling layer.
    """

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_kv_head: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        pages: KVPages | None = None,
        rolling: Collection[int] = (),
        window: int = 0,
        rollback: int = 0,
    ) -> None:
        super().__init__()
        if rolling and window < 1:
            raise ValueError(f"rolling layers need a positive window, got {window}")
        self.batch_size, self.max_len, self.pages = batch_size, max_len, pages
        self.limit = max_len  # the leading slots a step's queries may see (:meth:`visible`); a serving engine cuts it
        if pages is not None and (pages.table.shape[0], pages.max_len) != (batch_size, max_len):
            raise ValueError(f"a page table of {tuple(pages.table.shape)} rows/pages for max_len {pages.max_len} "
                             f"does not fit a cache of {batch_size} rows x {max_len} slots")
        self.rolling, self.window = frozenset(rolling), window
        ring = min(window + rollback, max_len) + 1 if rolling else 0  # with the scratch entry
        self.layers = nn.ModuleList(
            RollingKVCache(batch_size, n_kv_head, ring, head_dim, dtype=dtype, device=device) if i in self.rolling
            else PagedKVCache(pages, n_kv_head, head_dim, dtype=dtype) if pages is not None
            else KVCache(batch_size, n_kv_head, max_len, head_dim, dtype=dtype, device=device)
            for i in range(n_layer)
        )
        self.register_buffer("key_valid", torch.zeros(batch_size, max_len, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("ring_slot", torch.full((batch_size, ring), -1, device=device), persistent=False)

    def mark(self, slots: Tensor, token_valid: Tensor | None = None) -> None:
        """Record ``slots`` (``(T,)`` shared or ``(B, T)`` per row) as written, real where ``token_valid
        (B, T)`` says so (all of them by default)."""
        length = slots.shape[-1]
        valid = torch.ones(self.batch_size, length, dtype=torch.bool, device=slots.device) if token_valid is None else token_valid
        per_row = slots if slots.dim() == 2 else slots.expand(self.batch_size, length)
        rows = torch.arange(self.batch_size, device=slots.device)[:, None]
        self.key_valid[rows, per_row] = valid  # indexed writes, not scatter_: see KVCache.write
        if self.rolling:
            self.ring_slot[rows, self.ring_entries(per_row, token_valid)] = per_row
            self.ring_slot[:, -1] = -1  # the scratch entry holds nothing a query may see

    def ring_entries(self, slots: Tensor, token_valid: Tensor | None = None) -> Tensor:
        """``(B, T)``: where the rolling layers store each position of a step at ``slots`` (``(T,)`` or ``(B, T)``):
        entry ``slot % ring`` for a row's real tokens among its newest ``ring`` slots (consecutive, so no two
        share an entry), the scratch entry ``ring`` for the others (padding; a long step's older tokens)."""
        per_row = slots if slots.dim() == 2 else slots.expand(self.batch_size, slots.shape[-1])
        ring = self.ring_slot.shape[1] - 1
        real = torch.ones_like(per_row, dtype=torch.bool) if token_valid is None else token_valid
        newest = torch.where(real, per_row, -1).amax(1, keepdim=True)
        return torch.where(real & (per_row > newest - ring), per_row % ring, ring)

    def mask(self, slots: Tensor) -> Tensor:
        """The ``(B, 1, T, S')`` mask of queries at ``slots`` over what has been marked (see :func:`cache_mask`),
        or, for a decode step reading pages, the same mask as a block mask over the pool.

        ``S'`` is :meth:`visible`: on an eager CPU step, only the slots up to the furthest query's (no query sees
        a later one), so attention, which reads the keys a narrower mask covers (:func:`~blockloop.nn.attention.
        attention`), reads what the rows hold rather than the whole static cache (a server's slots are the
        model's context long); :attr:`limit` everywhere else."""
        if self.pages is not None and self.pages.reads_pool(slots):
            return self.pages.pool_mask(self.key_valid, slots)
        return cache_mask(self.key_valid[:, : self.visible(slots)], slots)

    def visible(self, slots: Tensor) -> int:
        """How many leading slots queries at ``slots`` may see: :attr:`limit`, or one past the furthest query where
        that is fewer on an eager CPU step (:func:`~blockloop.nn.masks.visible_slots`).

        :attr:`limit` is every slot unless whoever steps the cache knows, on the host, that no query of the coming
        steps sits at or past a shorter one (:meth:`limit_keys`): a serving engine knows each request's length and
        cuts the keys a step reads to one of a few lengths (a static shape each), so a static cache's step reads
        about what its rows hold, not ``max_len`` slots per row. A query at or past the limit would silently miss
        its newest keys: the limit is a promise of the caller's."""
        return visible_slots(slots, self.limit)

    def limit_keys(self, slots: int) -> None:
        """Let steps read the first ``slots`` slots only (at most ``max_len``; see :meth:`visible`), the paged layers'
        gathered reads included."""
        self.limit = min(slots, self.max_len)
        for layer in self.layers:
            if isinstance(layer, PagedKVCache):
                layer.pages.limit = self.limit

    def rolling_mask(self, slots: Tensor, token_valid: Tensor | None = None) -> Tensor:
        """The rolling layers' ``(B, 1, T, ring + 1 + T)`` mask of a step at ``slots`` (see :func:`ring_mask`):
        build it before the step marks its slots, it describes the rings :meth:`RollingKVCache.write` returns."""
        return ring_mask(self.ring_slot, self.key_valid, slots, token_valid, self.window)

    def reset(self, rows: Tensor | None = None) -> None:
        """Forget what every row (or the rows where ``rows (B,)`` is True) has cached."""
        if rows is None:
            self.key_valid.zero_()
            self.ring_slot.fill_(-1)
        else:
            self.key_valid[rows] = False
            self.ring_slot[rows] = -1

    def take(self, source: DecoderCache, rows: Tensor) -> None:
        """Row ``i`` takes over row ``rows[i]`` of ``source``, a cache of the same layout written at shared slots
        ``0 .. source.max_len - 1`` (a prompt prefix cached once and shared by several continuations)."""
        slots = torch.arange(source.max_len, device=rows.device)
        for i, (mine, theirs) in enumerate(zip(self.layers, source.layers)):
            if i in self.rolling:  # the slots the source's ring kept, into this one's entries
                held = slots[-theirs.ring :]
                index, where = held % theirs.ring, self.ring_entries(held)[0]
            else:
                held = index = where = slots
            mine.write(where, theirs.k[rows][:, :, index], theirs.v[rows][:, :, index])
        # A larger ring here also records the prefix slots the source's ring dropped: they are more than
        # ``window`` slots before any query to come, so no mask shows them.
        self.mark(slots, source.key_valid[rows])

    def rows(self, start: int, stop: int) -> DecoderCache:
        """Rows ``start .. stop - 1`` as a cache whose buffers are views of this one (prefill into slots while
        the other rows keep their state). A subclass's view is of its own class: it adds its own attributes."""
        view = type(self).__new__(type(self))
        nn.Module.__init__(view)
        view.batch_size, view.max_len, view.limit = stop - start, self.max_len, self.limit
        view.pages = self.pages.rows(start, stop) if self.pages is not None else None
        view.rolling, view.window = self.rolling, self.window
        view.layers = nn.ModuleList(layer.rows(start, stop) for layer in self.layers)
        view.register_buffer("key_valid", self.key_valid[start:stop], persistent=False)
        view.register_buffer("ring_slot", self.ring_slot[start:stop], persistent=False)
        return view


class KVWriter(Protocol):
    """Anything an attention layer can store keys/values in: a :class:`KVCache`, or a recursive runner's view
    of one shared layer with each row at its own loop."""

    def write(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


@dataclass
class LayerStep:
    """One attention layer's part of a cached step: its cache and the slots this step writes there."""

    cache: KVWriter
    slots: Tensor

    def write(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this step's ``k, v (B, H_kv, T, D)`` and return the whole cache to attend over."""
        return self.cache.write(self.slots, k, v)


@dataclass
class StepContext:
    """One cached forward pass: the ``cache``, the ``slots`` its tokens are written at (``(T,)`` shared or
    ``(B, T)`` per row), their rotary ``positions`` (default: the slots) and which are real tokens
    (``token_valid (B, T)``, default all)."""

    cache: DecoderCache
    slots: Tensor
    positions: Tensor | None = None
    token_valid: Tensor | None = None
    ring_entries: Tensor | None = field(init=False, default=None)  # the rolling layers' entries, once per step
    layer_caches: list[KVWriter] = field(init=False)  # cache.layers as a list: indexing a ModuleList is slow

    def __post_init__(self) -> None:
        self.layer_caches = list(self.cache.layers)
        if self.cache.rolling:
            self.ring_entries = self.cache.ring_entries(self.slots, self.token_valid)

    def layer(self, index: int, cache: KVWriter | None = None) -> LayerStep:
        """Layer ``index``'s write of this step (into ``cache`` instead, when a model lays its layers out
        itself, e.g. one shared layer per loop): at the step's slots, or a rolling layer's ring entries."""
        slots = self.ring_entries if index in self.cache.rolling else self.slots
        return LayerStep(self.layer_caches[index] if cache is None else cache, slots)

    @property
    def token_positions(self) -> Tensor:
        return self.slots if self.positions is None else self.positions

    def begin(self) -> Tensor:
        """Mark this step's slots written and return the mask of its queries (:meth:`DecoderCache.mask`): the one
        place a forward pass makes its tokens visible."""
        self.cache.mark(self.slots, self.token_valid)
        return self.cache.mask(self.slots)

    def begin_rolling(self) -> tuple[Tensor, Tensor | None]:
        """:meth:`begin`'s mask, and the rolling layers' (:meth:`DecoderCache.rolling_mask`, built from the rings
        before this step) when the cache has any."""
        rolling = self.cache.rolling_mask(self.slots, self.token_valid) if self.cache.rolling else None
        return self.begin(), rolling

    def begin_rings(self) -> Tensor:
        """:meth:`begin` for a model whose every layer entry is a ring and reads no other mask (Transformer-XL's
        span): only the rings' mask, built before the step's slots are marked."""
        rolling = self.cache.rolling_mask(self.slots, self.token_valid)
        self.cache.mark(self.slots, self.token_valid)
        return rolling
