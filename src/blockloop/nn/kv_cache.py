"""Static key/value caches: preallocated once, written in place at explicit slots.

Growing a cache with ``torch.cat`` reallocates and copies it every step and changes shapes, which
defeats CUDA graphs and ``torch.compile``. Here each layer owns fixed ``(B, H_kv, S, D)`` buffers and a
step writes its keys/values with ``index_copy_`` at slot indices. Which slots hold a real token (not
left padding, not yet written) is tracked once per model in :class:`DecoderCache`.
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
        """Store ``k, v (B, H_kv, T, D)`` at ``slots (T,)`` and return the whole cache to attend over."""
        self.k.index_copy_(2, slots, k.to(self.k.dtype))
        self.v.index_copy_(2, slots, v.to(self.v.dtype))
        return self.k, self.v


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
        """Mark ``slots`` as written and return the ``(B, 1, T, S)`` mask for queries at ``slots``.

        A query sees valid keys at or before its own slot, and always itself, so that a padding query
        still has one key and its (unused) output stays finite.
        """
        valid = torch.ones(self.batch_size, slots.numel(), dtype=torch.bool, device=slots.device) if token_valid is None else token_valid
        self.key_valid[:, slots] = valid
        key_slots = torch.arange(self.max_len, device=slots.device)
        causal = key_slots[None, :] <= slots[:, None]
        own = key_slots[None, :] == slots[:, None]
        return ((causal[None] & self.key_valid[:, None, :]) | own[None]).unsqueeze(1)

    def reset(self) -> None:
        self.key_valid.zero_()
