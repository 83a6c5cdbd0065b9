"""Every attention mask the models build, in one place (True = may attend).

Three forms, all accepted by :func:`~blockloop.nn.attention.attention`: a FlexAttention-style
``mask_mod(b, h, q_idx, kv_idx) -> bool`` (full windows: causal, sliding window), a dense boolean
tensor broadcastable to ``(B, H, Tq, Tk)`` (caches, padding, block structures), or a FlexAttention
``BlockMask`` built directly from a known block structure (the double decoder's partitions,
:func:`dual_block_mask`), so that no eager ``create_block_mask`` runs per batch. Building a mask never
changes the state it reads: a cache marks its written slots separately
(:meth:`~blockloop.nn.kv_cache.DecoderCache.mark`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

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


def ring_mask(ring_slot: Tensor, key_valid: Tensor, slots: Tensor, token_valid: Tensor | None, window: int) -> Tensor:
    """``(B, 1, T, R + T)`` mask of a step's ``T`` queries at cache ``slots`` (``(T,)`` shared or ``(B, T)`` per row)
    over a rolling cache's ``R`` ring entries then the step's own ``T`` keys
    (:class:`~blockloop.nn.kv_cache.RollingKVCache`): a sliding window of ``window`` slots, exact.

    ``ring_slot (B, R)`` is the slot each entry held before the step (-1: none), ``key_valid (B, S)`` which slots
    hold real tokens. A ring entry is seen when its slot is real, at or before the query and less than
    ``window`` slots back, and not one of the step's own slots (those keys come with the step: the entry still
    holds an older slot's, or a rejected draft's). Among the step's keys a query sees the real ones at or before
    it in the window, and always itself, so a padding query stays finite.
    """
    batch = ring_slot.shape[0]
    per_row = slots if slots.dim() == 2 else slots.expand(batch, slots.shape[-1])
    query = per_row[:, :, None]
    held = ring_slot[:, None, :]
    real = (ring_slot >= 0) & key_valid.gather(1, ring_slot.clamp_min(0)) & ~(held == query).any(1)
    ring = real[:, None, :] & (held <= query) & (held > query - window)
    own = per_row[:, None, :]
    step = (own <= query) & (own > query - window)
    if token_valid is not None:
        step = step & token_valid[:, None, :]
    step = step | torch.eye(per_row.shape[1], dtype=torch.bool, device=slots.device)
    return torch.cat((ring, step), -1).unsqueeze(1)


def sees_cached(key_slot: Tensor, query_slot: Tensor, key_valid: Tensor) -> Tensor:
    """The rule of every cache mask, elementwise (also inside FlexAttention ``mask_mod``s over pages and loops):
    a query sees valid keys at or before its own slot, and always itself, so that a padding query still has
    one key and its (unused) output stays finite."""
    return (key_slot <= query_slot) & key_valid | (key_slot == query_slot)


def visible_slots(slots: Tensor, limit: int) -> int:
    """How many leading cache slots queries at ``slots`` may need: ``limit``, or one past the furthest query where
    that is fewer and learning it is free (eager, on CPU: a CUDA step would wait for the device, a compiled one has
    static shapes). No query sees a later slot than its own (:func:`sees_cached`), so a mask, and the keys read
    under it, need go no further."""
    if slots.is_cpu and not torch.compiler.is_compiling():
        return min(int(slots.max()) + 1, limit)
    return limit


def cache_mask(key_valid: Tensor, slots: Tensor) -> Tensor:
    """``(B, 1, T, S)`` mask of queries at cache ``slots`` (``(T,)`` shared or ``(B, T)`` per row) over a
    cache whose written, real slots are ``key_valid (B, S)`` (:func:`sees_cached`).
    """
    batch, max_len = key_valid.shape
    per_row = slots if slots.dim() == 2 else slots.expand(batch, slots.shape[-1])
    key_slots = torch.arange(max_len, device=slots.device)
    return sees_cached(key_slots, per_row[..., None], key_valid[:, None, :]).unsqueeze(1)


def window_mask(prefix_valid: Tensor, valid: Tensor, span: int | None = None) -> Tensor:
    """``(B, 1, T, P + T)`` boolean mask for ``T`` queries over ``P`` prefix keys then their own ``T`` keys
    (the staircase family's cache / memory before the window; Staircase section 3.1's causal masking).

    Keys are laid out in stream order (prefix first). A query sees earlier-or-equal keys that are valid
    and, with ``span``, at most ``span`` positions back; it always sees itself, so padding queries stay finite.
    """
    P, T = prefix_valid.shape[1], valid.shape[1]
    keys_valid = torch.cat((prefix_valid, valid), dim=1)
    q_pos = torch.arange(P, P + T, device=valid.device)[:, None]
    k_pos = torch.arange(P + T, device=valid.device)[None, :]
    mask = sees_cached(k_pos, q_pos, keys_valid[:, None, :])  # the cache rule, over stream positions
    if span is not None:
        mask = mask & (q_pos - k_pos <= span)  # a query itself is at distance 0: always kept
    return mask.unsqueeze(1)


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


def dual_mask_mod(boundaries: Tensor, length: int) -> MaskMod:
    """The double decoder's joint mask over ``2 * length`` keys: keys ``[0, T)`` are the cross keys (projected
    from the context latents h_s), keys ``[T, 2T)`` the generation decoder's own; query t sees cross key s when
    s's block is earlier than t's, own key T + s when s is in t's block at a position <= t (:func:`block_masks`,
    side by side). Indices are clamped into range so a kernel evaluating padded tiles never reads past ``block``.
    """
    block = block_ids(boundaries, torch.arange(length, device=boundaries.device))

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        own = kv_idx >= length
        s = torch.where(own, kv_idx - length, kv_idx).clamp(0, length - 1)
        t = q_idx.clamp(0, length - 1)
        return torch.where(own, (block[s] == block[t]) & (s <= t), block[s] < block[t])

    return mask_mod


def dual_block_mask(boundaries: Tensor, length: int, block_size: int = 128) -> BlockMask:
    """:func:`dual_mask_mod` as a FlexAttention ``BlockMask``, computed from the partition on the tile grid
    (no ``length x 2 length`` evaluation): the eager ``create_block_mask`` cost more than the attention
    itself on an H100 (11.8 ms per batch for the two masks of the LSE-merged form).

    Block ids are monotone in position, so for a query tile ``[qa, qb)`` and the keys ``[ka, kb)`` of one
    key tile lying in one half (a tile straddling ``T`` is split in two parts):

    * cross part: some key visible iff ``block[ka] < block[qb-1]``, all iff ``block[kb-1] < block[qa]``;
    * own part: some key visible iff ``ka <= qb-1`` and, with ``s = min(kb, qb) - 1``, ``s >= qa`` or
      ``block[s] == block[qa]``; all iff ``kb - 1 <= qa`` and ``block[ka] == block[qb-1]``.

    A tile with every key visible is a full block (no ``mask_mod`` call), one with some a partial block;
    the result equals ``create_block_mask(dual_mask_mod(...), 1, 1, T, 2 T)``, broadcast over batch and heads.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = boundaries.device
    block = block_ids(boundaries, torch.arange(length, device=device))
    n_q, n_kv = -(-length // block_size), -(-2 * length // block_size)
    qa = torch.arange(n_q, device=device) * block_size
    qb = (qa + block_size).clamp_max(length)
    ka = torch.arange(n_kv, device=device) * block_size
    kb = (ka + block_size).clamp_max(2 * length)
    qa, qb = qa[:, None], qb[:, None]
    # the cross part of each key tile, [ca, cb), and its own part, [oa, ob), in sequence positions
    ca, cb = ka.clamp_max(length), kb.clamp_max(length)
    oa, ob = ka.clamp_min(length) - length, kb.clamp_min(length) - length
    has_cross, has_own = ca < cb, oa < ob
    ca, cb, oa, ob = ca.clamp_max(length - 1), cb.clamp_min(1), oa.clamp_max(length - 1), ob.clamp_min(1)
    cross_any = has_cross & (block[ca] < block[qb - 1])
    cross_all = ~has_cross | (block[cb - 1] < block[qa])
    last = torch.minimum(ob, qb) - 1
    own_any = has_own & (oa <= qb - 1) & ((last >= qa) | (block[last.clamp_min(0)] == block[qa]))
    own_all = ~has_own | ((ob - 1 <= qa) & (block[oa] == block[qb - 1]))
    # as create_block_mask does, a tile running past the end of the sequence (padding) is never full
    whole = (qa + block_size <= length) & (ka + block_size <= 2 * length)
    full = cross_all & own_all & whole
    partial = (cross_any | own_any) & ~full

    def layout(visible: Tensor) -> tuple[Tensor, Tensor]:
        counts = visible.sum(-1, dtype=torch.int32)
        indices = torch.argsort(visible.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None], indices[None, None]

    return BlockMask.from_kv_blocks(*layout(partial), *layout(full), BLOCK_SIZE=block_size,
                                    mask_mod=dual_mask_mod(boundaries, length), seq_lengths=(length, 2 * length))


def decode_block_mask(counts: Tensor, indices: Tensor, kv_block: int, kv_length: int, mask_mod: MaskMod) -> BlockMask:
    """The FlexAttention mask of one decode query per row over ``kv_length`` keys: row ``b`` visits the first
    ``counts[b]`` of its key blocks ``indices[b]`` (``kv_block`` keys each) and sees in them what ``mask_mod`` says.

    Built from those device tensors with no eager ``create_block_mask`` pass, so it is cheap enough to rebuild at
    every step and lives inside a captured step. One query block per row: its size (128) only has to be a multiple
    of the kernel's, not 1. Inductor's CPU kernel wants the index list to span every key block, so on CPU it is
    padded with block 0 past ``counts`` (never visited); on CUDA each row lists only its own.
    """
    from torch.nn.attention.flex_attention import BlockMask

    rows = indices.shape[0]
    if not indices.is_cuda:
        indices = torch.nn.functional.pad(indices, (0, -(-kv_length // kv_block) - indices.shape[1]))
    return BlockMask.from_kv_blocks(
        counts.view(rows, 1, 1).int(), indices.view(rows, 1, 1, -1).int(), BLOCK_SIZE=(128, kv_block),
        mask_mod=mask_mod, seq_lengths=(1, kv_length), compute_q_blocks=False)
