"""Every attention mask the models build, in one place (True = may attend).

Two forms, both accepted by :func:`~blockloop.nn.attention.attention`: a FlexAttention-style
``mask_mod(b, h, q_idx, kv_idx) -> bool`` (full windows: causal, sliding window), or a dense boolean
tensor broadcastable to ``(B, H, Tq, Tk)`` (caches, padding, block structures). Building a mask never
changes the state it reads: a cache marks its written slots separately
(:meth:`~blockloop.nn.kv_cache.DecoderCache.mark`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def causal_mask_mod(offset: int = 0) -> MaskMod:
    """Query ``i`` sees keys ``<= i + offset`` (offset = Tk - Tq when queries are the last Tq keys)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx + offset >= kv_idx

    return mask_mod


def sliding_window_mask_mod(window: int, offset: int = 0) -> MaskMod:
    """Causal attention to the last ``window`` positions only (the query's own included), as Gemma-3's
    local layers: query ``i`` (at key position ``i + offset``) sees keys ``j`` with ``0 <= i + offset - j < window``.
    """

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx + offset - kv_idx
        return (distance >= 0) & (distance < window)

    return mask_mod


def within_window(query_slots: Tensor, n_keys: int, window: int) -> Tensor:
    """``(Tq, n_keys)`` for shared query slots ``(Tq,)``, or ``(B, 1, Tq, n_keys)`` for per-row ones ``(B, Tq)``:
    which cache slots lie less than ``window`` slots before each query's slot, the band that restricts a
    cache's mask to a sliding window."""
    key_slots = torch.arange(n_keys, device=query_slots.device)
    band = key_slots > query_slots[..., None] - window
    return band if query_slots.dim() == 1 else band[:, None]


def within_span(query_slots: Tensor, n_keys: int, span: int) -> Tensor:
    """``(B or 1, 1, Tq, n_keys)``: which cache slots lie at most ``span`` slots before each query's slot
    (Transformer-XL's fixed attention span over a cache); ``query_slots`` are ``(T,)`` shared or ``(B, T)``."""
    per_row = query_slots if query_slots.dim() == 2 else query_slots[None]
    distance = per_row[:, None, :, None] - torch.arange(n_keys, device=query_slots.device)
    return distance <= span


def cache_mask(key_valid: Tensor, slots: Tensor) -> Tensor:
    """``(B, 1, T, S)`` mask of queries at cache ``slots`` (``(T,)`` shared or ``(B, T)`` per row) over a
    cache whose written, real slots are ``key_valid (B, S)``.

    A query sees valid keys at or before its own slot, and always itself, so that a padding query still
    has one key and its (unused) output stays finite.
    """
    batch, max_len = key_valid.shape
    per_row = slots if slots.dim() == 2 else slots.expand(batch, slots.shape[-1])
    key_slots = torch.arange(max_len, device=slots.device)
    causal = key_slots <= per_row[..., None]
    own = key_slots == per_row[..., None]
    return ((causal & key_valid[:, None, :]) | own).unsqueeze(1)


def window_mask(prefix_valid: Tensor, valid: Tensor, span: int | None = None) -> Tensor:
    """``(B, 1, T, P + T)`` boolean mask for ``T`` queries over ``P`` prefix keys then their own ``T`` keys
    (the staircase family's cache / memory before the window).

    Keys are laid out in stream order (prefix first). A query sees earlier-or-equal keys that are valid
    and, with ``span``, at most ``span`` positions back; it always sees itself, so padding queries stay finite.
    """
    P, T = prefix_valid.shape[1], valid.shape[1]
    keys_valid = torch.cat((prefix_valid, valid), dim=1)
    q_pos = torch.arange(P, P + T, device=valid.device)[:, None]
    k_pos = torch.arange(P + T, device=valid.device)[None, :]
    visible = k_pos <= q_pos
    if span is not None:
        visible = visible & (q_pos - k_pos <= span)
    mask = visible[None] & keys_valid[:, None, :]
    return (mask | (k_pos == q_pos)[None]).unsqueeze(1)


def own_keys_mask(n_queries: int, n_keys: int, causal: bool, device: torch.device) -> Tensor:
    """``(T, K)`` dense mask of the last ``T`` of ``K`` positions over all ``K``: causal, or everything."""
    own = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    return own.tril(n_keys - n_queries) if causal else own


def with_visible_prefix(mask: Tensor, prefix_len: int) -> Tensor:
    """``mask (..., T, K)`` over a sequence's own keys, widened to ``(..., T, P + K)`` by ``prefix_len``
    prefix keys in front that every query sees (the Relaxed Recursive Transformer's appendix K prefix)."""
    return torch.cat((mask.new_ones(*mask.shape[:-1], prefix_len), mask), dim=-1)


def padding_mask(valid: Tensor) -> Tensor:
    """``(B, 1, T, T)`` bidirectional mask over ``valid (B, T)`` tokens (an encoder's): a query sees every
    real key; a padding query also sees itself, so every row stays finite."""
    own = torch.eye(valid.shape[1], dtype=torch.bool, device=valid.device)
    return valid[:, None, None, :] | own


def block_ids(boundaries: Tensor, positions: Tensor) -> Tensor:
    """The block k with b_k <= position < b_{k+1}, for each position."""
    return torch.bucketize(positions, boundaries.to(positions.device), right=True) - 1


def block_masks(boundaries: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """A double decoder's generation-decoder masks ``(T, T)`` under the partition ``boundaries (K + 1,)``:

    * within-block: key in the query's block at a position <= the query's (causal self-attention);
    * cross-block: key in an earlier block (the context latents h_s of blocks m < k).

    They are disjoint and together never reach a key after the query: no token sees the future.
    """
    positions = torch.arange(length, device=boundaries.device)
    block = block_ids(boundaries, positions)
    within = (block[:, None] == block[None, :]) & (positions[:, None] >= positions[None, :])
    cross = block[None, :] < block[:, None]
    return within, cross
