"""A Triton kernel for one decode query per row over a paged KV pool, reading each row's live keys only.

Why it exists: the H200 profile of 2026-11-28 (``benchmarks/results/decode_profile-nvidia-h200.md``) timed
FlexAttention's kernel over the page table at about 1.5 TB/s of live bytes, where cuDNN's SDPA reads a static
cache at 3.5 TB/s. Decode is a read of the cache, so the paged engine lost to the static one it was built to beat.
Issue 12 asks for a kernel of our own exactly where a measurement shows that gap; this is it, and
``benchmarks/decode_profile.py`` (part 4) times it beside Flex and the static read. The engine reads its pages
with it when asked (``Paging(..., read="kernel")``); it becomes the default only once a GPU measurement shows it
wins.

What it computes is what :meth:`~blockloop.nn.paged_cache.KVPages.pool_mask` asks of FlexAttention, with the
same pool layout (:mod:`blockloop.nn.paged_cache`): row ``b``'s logical slot ``s`` lives at pool position
``table[b, s // page_size] * page_size + s % page_size``; its query at slot ``query[b]`` sees the slots
``s <= query[b]`` whose ``key_valid[b, s]`` is set, and always itself (:func:`~blockloop.nn.masks.sees_cached`),
within the ``reserved[b]`` pages it holds; with ``local[b]`` set, only the last ``window`` of them (a
sliding-window layer).

How: one program per (row, key/value head), or per (row, head, split) where too few rows would leave the GPU idle
(each split takes a run of the row's tiles and the softmaxes are merged by their log-sum-exps, as FlashAttention's
flash-decoding does). A program walks its slots of ``0 .. query[b]`` in tiles of ``TILE`` keys, looks each key's
page up in the table (so a tile may span pages of any size), and keeps the online softmax of FlashAttention
(running maximum ``m``, normaliser ``denom``, accumulator) for the ``G`` query heads that share the key/value head,
so grouped keys are read once, never copied per query head. Those heads are the rows of a tile padded to 16 (and
the head size to a power of two of at least 16), so the scores and the weighted values are matrix products
(``tl.dot``, tensor cores) over keys and values kept in their own type: the compiler then pipelines the tiles'
loads as asynchronous copies into shared memory, and the loop's state fits in registers (a first version, with a
(G, TILE, D) product in float32, did not: it spilled, and nothing was in flight while it computed). Only the keys
a query sees are loaded, so bytes read per step are the sum of live lengths, and the stale bytes of pages no row
holds (NaN, infinity) never meet a zero weight. Offsets are 64-bit: a pool of a few GB passes 2^31 elements.

On CPU the same kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` before triton is first imported;
``torch.compile`` imports it too), which is how the tests check its numbers without a GPU; its speed-relevant
shape (pipelined copies, tensor-core products, no spills) is checked by compiling it for an H100 here.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from blockloop.nn.paged_cache import multiprocessors

# Whether kernels run in Triton's interpreter (CPU), read once: the flag is a C++ call torch.compile cannot trace
INTERPRETED = bool(triton.knobs.runtime.interpret)
LOG2_E = 1.4426950408889634  # scores are taken in base 2


@triton.jit
def _paged_decode(
    Q, K, V, Out, Lse, Table, Reserved, Query, Valid, Local,  # pointers
    stride_qb, stride_qh, stride_kh, stride_kp, stride_ob, stride_oh, stride_lb, stride_tb, stride_vb,
    scale_log2, window, last,
    GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLITS: tl.constexpr, WIDEN: tl.constexpr,
):
    # 64-bit program ids: a head's offset in a pool of a few GB passes 2^31
    row, kv_head, split = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    query_slot = tl.load(Query + row)
    # The G query heads that read this key/value head, as the rows of a tile of at least 16 (tl.dot's least):
    # grouped keys are read once, never copied per query head, and the scores and weighted values are matrix
    # products, so the keys and values stay in their own type and the loads can be pipelined.
    group = tl.arange(0, GROUPS_PAD)
    heads = kv_head * GROUPS + group
    head_ok = group < GROUPS
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32) if WIDEN else q.to(K.dtype.element_ty)
    first = 0
    if HAS_WINDOW:
        local = tl.load(Local + row) != 0
        first = tl.where(local, tl.maximum(query_slot - window + 1, 0), 0)
    # A finite start for the running maximum: a tile whose keys are all masked leaves it as it is (exp(-inf) = 0)
    # instead of subtracting -inf from -inf.
    m = tl.full((GROUPS_PAD,), -1.0e30, tl.float32)
    denom = tl.zeros((GROUPS_PAD,), tl.float32)
    acc = tl.zeros((GROUPS_PAD, HEAD_DIM_PAD), tl.float32)
    # The row's last slot read: its query's (a query past every key, cross attention's, reads them all and not
    # itself), within the pages it holds: a row past its reservation (an idle slot) sees nothing, as under Flex.
    top = tl.minimum(tl.minimum(query_slot, last), tl.load(Reserved + row) * PAGE - 1)
    # This program's share of the row's tiles: all of them, or one of SPLITS consecutive runs (flash-decoding)
    lowest = (first // TILE) * TILE
    per_split = tl.cdiv(tl.maximum(top + 1 - lowest, 0), TILE * SPLITS) * TILE
    begin = lowest + split * per_split
    for start in range(begin, tl.minimum(begin + per_split, top + 1), TILE):
        slots = start + tl.arange(0, TILE)
        live = slots <= top
        valid = tl.load(Valid + row * stride_vb + slots, mask=live, other=0) != 0
        seen = live & (valid | (slots == query_slot))
        if HAS_WINDOW:
            seen = seen & (slots >= first)
        page = tl.load(Table + row * stride_tb + slots // PAGE, mask=seen, other=0)
        where = (page * PAGE + slots % PAGE)[:, None] * stride_kp + kv_head * stride_kh + dims[None, :]
        # only the keys the query sees are loaded: a masked slot's stale bytes (NaN, inf) never meet a zero weight
        kv_mask = seen[:, None] & dim_ok[None, :]
        k = tl.load(K + where, mask=kv_mask, other=0.0)
        v = tl.load(V + where, mask=kv_mask, other=0.0)
        if WIDEN:
            k, v = k.to(tl.float32), v.to(tl.float32)
        # scores in base 2 (the scale carries log2(e)): exp2 is the GPU's native exponential
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # (G, TILE)
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    seen_any = denom > 0
    denom = tl.where(seen_any, denom, 1.0)
    out = acc / denom[:, None]  # a row that sees no key gets zeros, as Flex gives it
    out_mask = head_ok[:, None] & dim_ok[None, :]
    if SPLITS == 1:
        tl.store(Out + row * stride_ob + heads[:, None] * stride_oh + dims[None, :], out.to(Out.dtype.element_ty),
                 mask=out_mask)
    else:  # this split's softmax over its keys, Out (B, Hq, SPLITS, D), and their log-sum-exp, Lse (B, Hq, SPLITS)
        tl.store(Out + row * stride_ob + heads[:, None] * stride_oh + split * HEAD_DIM + dims[None, :], out,
                 mask=out_mask)
        lse = (m + tl.log2(denom)) * 0.6931471805599453  # back to natural log: ln 2
        tl.store(Lse + row * stride_lb + heads * SPLITS + split, tl.where(seen_any, lse, float("-inf")), mask=head_ok)


def paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    reserved: Tensor,
    query: Tensor,
    key_valid: Tensor,
    *,
    page_size: int,
    scale: float | None = None,
    local: Tensor | None = None,
    window: int = 0,
    tile: int = 64,
    splits: int | None = None,
) -> Tensor:
    """Attention of one query per row, ``q (B, Hq, 1, D)``, over pools ``k_pool, v_pool (1, Hkv, positions, D)``
    through page ``table (B, W)`` of which each row holds its first ``reserved (B,)`` pages, each row's query at
    slot ``query (B,)`` over its ``key_valid (B, S)`` slots (a query at slot ``S`` or later sees every valid one:
    cross attention's); ``local (B,)`` with ``window``: those rows see only their last ``window`` slots. Returns
    ``(B, Hq, 1, D)``; a row that sees no key, zeros.

    ``splits``: how many programs share each row and key/value head, each over a run of its tiles, their softmaxes
    then merged by their log-sum-exps (FlashAttention's "flash-decoding"). One program per row and head keeps a GPU
    busy only with enough rows; the default splits each so there are about two programs per multiprocessor."""
    batch, heads, steps, dim = q.shape
    kv_heads = k_pool.shape[1]
    if steps != 1:
        raise ValueError(f"the paged decode kernel takes one query per row, got {steps}")
    if heads % kv_heads:
        raise ValueError(f"{kv_heads} key/value heads do not divide {heads} query heads")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"the kernel's tile must be a power of two of at least 16 keys (its matrix products' "
                         f"least), got {tile}")
    if table.shape[1] * page_size < key_valid.shape[1]:
        raise ValueError(f"a page table of {table.shape[1]} pages of {page_size} does not cover the "
                         f"{key_valid.shape[1]} slots of key_valid")
    if local is not None and window < 1:
        raise ValueError(f"rows marked local need a window of at least one slot, got {window}")
    if not q.is_cuda and not INTERPRETED:
        raise ValueError("the paged decode kernel runs on CUDA, or on CPU in Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before triton is first imported")
    groups = heads // kv_heads
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    table, reserved, query = table.contiguous(), reserved.contiguous(), query.contiguous()
    valid = key_valid.contiguous().view(torch.uint8) if key_valid.dtype == torch.bool else key_valid.contiguous()
    # an unused pointer where no row is local: any tensor of the device, no allocation
    local_rows = query if local is None else local.to(torch.bool).contiguous().view(torch.uint8)
    if splits is None:
        splits = default_splits(batch * kv_heads, multiprocessors(q.device) if q.is_cuda else 0)
    if splits == 1:
        out, lse = torch.empty_like(q), q  # no log-sum-exp: the kernel writes the output itself
    else:
        out = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _paged_decode[(batch, kv_heads, splits)](
        q, k_pool, v_pool, out, lse, table, reserved, query, valid, local_rows,
        q.stride(0), q.stride(1), k_pool.stride(1), k_pool.stride(2), out.stride(0), out.stride(1), lse.stride(0),
        table.stride(0), valid.stride(0),
        (1.0 / math.sqrt(dim) if scale is None else scale) * LOG2_E, window, key_valid.shape[1] - 1,
        GROUPS=groups, GROUPS_PAD=max(16, triton.next_power_of_2(groups)), HEAD_DIM=dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(dim)), PAGE=page_size, TILE=tile, HAS_WINDOW=local is not None,
        SPLITS=splits, WIDEN=widened(k_pool.dtype),
    )
    if splits == 1:
        return out
    weights = torch.softmax(lse, dim=-1).nan_to_num(0.0)  # a split that saw no key weighs nothing; no key at all: 0
    return (weights.unsqueeze(-1) * out).sum(2, keepdim=True).to(q.dtype)


def widened(dtype: torch.dtype) -> bool:
    """Whether the kernel's matrix products take the keys and values in float32 rather than in their own type: a
    type the tensor cores do not take (float32 itself, exactly; float64), and bfloat16 in Triton's interpreter,
    whose product multiplies bfloat16's raw bits as integers (triton 3.9)."""
    return dtype not in (torch.float16, torch.bfloat16) or (dtype == torch.bfloat16 and INTERPRETED)


def default_splits(programs: int, processors: int) -> int:
    """Splits per row and head that make about two programs per multiprocessor (at most 16; one without a GPU's
    ``processors``, and where the rows alone fill it)."""
    return max(1, min(16, -(-2 * processors // programs))) if processors else 1

