"""Static key/value caches: preallocated once, written in place at explicit slots.

Growing a cache with ``torch.cat`` reallocates and copies it every step and changes shapes, which
defeats CUDA graphs and ``torch.compile``. Here each layer owns fixed ``(B, H_kv, S, D)`` buffers and a
step writes its keys/values in place at slot indices: either slots shared by every row ``(T,)`` (a
lock-step batch) or each row's own slots ``(B, T)`` (continuous batching, where every row of the batch is
a different request at its own length). Which slots hold a real token (not left padding, not yet
written) is tracked once per model in :class:`DecoderCache`; :meth:`DecoderCache.row` is a view of one
row, so a request can be prefilled into its slot while the other rows keep their state.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    """One attention layer's keys and values for ``batch_size`` rows and ``max_len`` slots."""

    def __init__(
        self, batch_size: int, n_kv_head: int, max_len: int, head_dim: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k, v (B, H_kv, T, D)`` at ``slots`` (``(T,)`` shared, or ``(B, T)`` per row) and return
        the whole cache to attend over."""
        if slots.dim() == 1:
            self.k.index_copy_(2, slots, k.to(self.k.dtype))
            self.v.index_copy_(2, slots, v.to(self.v.dtype))
        else:
            index = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            self.k.scatter_(2, index, k.to(self.k.dtype))
            self.v.scatter_(2, index, v.to(self.v.dtype))
        return self.k, self.v

    @classmethod
    def of(cls, k: Tensor, v: Tensor) -> KVCache:
        """A cache over existing ``(B, H_kv, S, D)`` buffers (views): writing it writes them."""
        view = cls.__new__(cls)
        nn.Module.__init__(view)
        view.register_buffer("k", k, persistent=False)
        view.register_buffer("v", v, persistent=False)
        return view

    def row(self, index: int) -> KVCache:
        """Row ``index`` as a batch of one whose buffers are views: writing it writes this cache."""
        return KVCache.of(self.k[index : index + 1], self.v[index : index + 1])


class RowLoopKV:
    """One shared layer's keys/values when each row of the batch runs its own loop (depth-wise batching).

    ``k, v`` are ``(loops, B, H_kv, S, D)``; row ``b`` reads and writes loop ``loop[b]``. Writing gathers
    each row's loop into a ``(B, H_kv, S, D)`` copy to attend over, so it costs one cache read more than
    a plain layer (a kernel that indexes the loop in place would avoid it).
    """

    def __init__(self, k: Tensor, v: Tensor, loop: Tensor) -> None:
        self.k, self.v, self.loop = k, v, loop

    def write(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store one token per row, ``k, v (B, H_kv, 1, D)`` at per-row ``slots (B, 1)``."""
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[self.loop, rows, :, slots[:, 0]] = k[:, :, 0].to(self.k.dtype)
        self.v[self.loop, rows, :, slots[:, 0]] = v[:, :, 0].to(self.v.dtype)
        return self.k[self.loop, rows], self.v[self.loop, rows]


class DecoderCache(nn.Module):
    """Per-layer KV caches plus which slots of each row hold a real token.

    Rows are independent: a row's keys are only visible to that row, and only where ``key_valid`` is
    set, so left-padded prompts of different lengths share one set of slot indices.
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
    ) -> None:
        super().__init__()
        self.batch_size, self.max_len = batch_size, max_len
        self.layers = nn.ModuleList(
            KVCache(batch_size, n_kv_head, max_len, head_dim, dtype=dtype, device=device) for _ in range(n_layer)
        )
        self.register_buffer("key_valid", torch.zeros(batch_size, max_len, dtype=torch.bool, device=device), persistent=False)

    def attention_mask(self, slots: Tensor, token_valid: Tensor | None) -> Tensor:
        """Mark ``slots`` (``(T,)`` shared or ``(B, T)`` per row) as written and return the ``(B, 1, T, S)``
        mask for queries at ``slots``.

        A query sees valid keys at or before its own slot, and always itself, so that a padding query
        still has one key and its (unused) output stays finite.
        """
        length = slots.shape[-1]
        valid = torch.ones(self.batch_size, length, dtype=torch.bool, device=slots.device) if token_valid is None else token_valid
        per_row = slots if slots.dim() == 2 else slots.expand(self.batch_size, length)
        self.key_valid.scatter_(1, per_row, valid)
        key_slots = torch.arange(self.max_len, device=slots.device)
        causal = key_slots <= per_row[..., None]
        own = key_slots == per_row[..., None]
        return ((causal & self.key_valid[:, None, :]) | own).unsqueeze(1)

    def reset(self) -> None:
        self.key_valid.zero_()

    def row(self, index: int) -> DecoderCache:
        """Row ``index`` as a cache of one row whose buffers are views of this one (prefill into a slot)."""
        view = DecoderCache.__new__(DecoderCache)
        nn.Module.__init__(view)
        view.batch_size, view.max_len = 1, self.max_len
        view.layers = nn.ModuleList(layer.row(index) for layer in self.layers)
        view.register_buffer("key_valid", self.key_valid[index : index + 1], persistent=False)
        return view

    @classmethod
    def looped(
        cls, n_layer: int, loops: int, batch_size: int, n_kv_head: int, max_len: int, head_dim: int, *,
        dtype: torch.dtype, device: torch.device | str,
    ) -> DecoderCache:
        """A cache for ``n_layer`` shared layers run ``loops`` times, with depth entry ``loop * n_layer + j``
        a view of loop ``loop`` of shared layer ``j``'s stacked buffers ``(loops, B, H_kv, S, D)``, so one
        batch can also run each row at its own loop (:meth:`loop_layer`)."""
        cache = cls(0, batch_size, n_kv_head, max_len, head_dim, dtype=dtype, device=device)
        shape = (loops, batch_size, n_kv_head, max_len, head_dim)
        cache.stacked = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                         for _ in range(n_layer)]
        cache.layers = nn.ModuleList(KVCache.of(cache.stacked[j][0][loop], cache.stacked[j][1][loop])
                                     for loop in range(loops) for j in range(n_layer))
        return cache

    def loop_layer(self, layer: int, loop: Tensor) -> RowLoopKV:
        """Shared layer ``layer`` with row ``b`` at loop ``loop[b]`` (a cache built by :meth:`looped`)."""
        if not hasattr(self, "stacked"):
            raise ValueError("rows at different loops need a cache built by DecoderCache.looped")
        return RowLoopKV(*self.stacked[layer], loop)
