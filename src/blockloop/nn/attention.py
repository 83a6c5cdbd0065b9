"""The one attention entry point every model calls.

``attention(q, k, v, ...)`` computes softmax(q k^T * scale + mask) v for grouped-query shapes and routes
to one of three backends:

* ``"sdpa"``  - ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU);
* ``"flex"``  - FlexAttention with a block mask built from a mask function (block-sparse masks such as
  the staircase or double-decoder ones, and the log-sum-exp on GPU);
* ``"eager"`` - a plain reference written from the formula, used to check the other two.

A mask is given either as ``causal=True``, as a dense boolean tensor (True = may attend) broadcastable
to ``(B, H, Tq, Tk)``, as a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool``, or as a FlexAttention
``BlockMask`` built once by the caller (block-sparse structure + its ``mask_mod``; FlexAttention uses it as it
is, so it is not rebuilt by the eager ``create_block_mask`` at every call; the other backends evaluate its
``mask_mod`` densely); every backend accepts every form (the builders live in :mod:`blockloop.nn.masks`).
A cache's mask for a decode step over a paged pool arrives as ``mask`` but is a ``BlockMask`` (the pool's
keys have batch 1, shared by every row): it is used as ``block_mask``, and only FlexAttention reads a pool, unless
the cache reads its pool with blockloop's Triton kernel (``read="kernel"``): then the mask is a
:class:`~blockloop.nn.paged_cache.PoolRead` and the kernel (:mod:`blockloop.nn.paged_decode`) computes the step.
A dense mask narrower than the keys covers the leading ones: no query sees the rest, which are not read (an
eager CPU step over a static cache passes only the slots up to its furthest query's, see
:meth:`~blockloop.nn.kv_cache.DecoderCache.mask`).
With ``Tq < Tk`` a causal query ``i`` sits at key position ``i + Tk - Tq``, which is what chunked prefill
over a cache needs. ``return_lse=True`` also returns the natural-log log-sum-exp of the scaled scores per
query, ``(B, H, Tq)``, which lets two attentions over disjoint key sets be merged exactly (the double-decoder
paper's form of its joint softmax; blockloop's double decoder makes it one call). A query row with no
visible key returns zeros and lse = -inf.

Grouped-query K/V are never copied per query head (a decode step would otherwise copy the whole cache):
FlexAttention takes ``enable_gqa``, and so does SDPA where its kernel reads grouped K/V as they are (on CPU; on a
GPU only without a mask); elsewhere (SDPA under a mask on a GPU, the eager path) each key/value head's G query heads
become one ``(B, Hkv, G * Tq, D)`` block of query rows against the un-expanded keys.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from blockloop.nn.masks import MaskMod, causal_mask_mod
from blockloop.nn.paged_cache import PoolRead
from blockloop.nn.precision import at_least_fp32

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

BACKENDS = ("sdpa", "flex", "eager")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    mask: Tensor | BlockMask | PoolRead | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of ``q (B, Hq, Tq, D)`` over ``k, v (B, Hkv, Tk, D)``, ``Hkv`` dividing ``Hq``.

    ``backend=None`` picks SDPA, or FlexAttention on CUDA / eager on CPU when the log-sum-exp is asked
    for (SDPA does not expose it); FlexAttention on CUDA for a ``block_mask`` too (its block sparsity is
    why it was built).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if isinstance(mask, PoolRead):
        return _pool_kernel(q, k, v, mask, scale, return_lse, dropout_p)
    pooled = mask is not None and not isinstance(mask, Tensor)  # a paged cache's BlockMask (see the module docstring)
    if pooled:
        mask, block_mask = None, mask
    elif mask is not None and mask.shape[-1] < k.shape[-2]:  # keys past a narrower mask: seen by no query, not read
        k, v = k[:, :, : mask.shape[-1]], v[:, :, : mask.shape[-1]]
    if (mask is not None) + (mask_mod is not None) + (block_mask is not None) + causal > 1:
        raise ValueError("give at most one of causal=True, mask, mask_mod, block_mask")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key/value heads do not divide {q.shape[1]} query heads")
    if backend is None:
        flex = pooled or (q.is_cuda and (return_lse or block_mask is not None))
        backend = "flex" if flex else ("eager" if return_lse else "sdpa")
    if block_mask is not None and backend != "flex":
        mask_mod = block_mask.mask_mod
    if backend == "sdpa":
        if return_lse:
            raise ValueError("the sdpa backend cannot return the log-sum-exp; use backend='flex' or 'eager'")
        return _sdpa(q, k, v, causal, mask, mask_mod, scale, dropout_p)
    if dropout_p:
        raise ValueError(f"attention dropout is only supported by the sdpa backend, not {backend!r}")
    if backend == "flex":
        out, lse = _flex(q, k, v, causal, mask, mask_mod, block_mask, scale, return_lse)
    elif backend == "eager":
        out, lse = _eager(q, k, v, _dense_mask(q, k, causal, mask, mask_mod), scale)
    else:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    return (out, lse) if return_lse else out


def _pool_kernel(q: Tensor, k: Tensor, v: Tensor, read: PoolRead, scale: float, return_lse: bool, dropout_p: float
                 ) -> Tensor:
    """A decode step over a paged pool read by the Triton kernel: the only backend that takes a :class:`PoolRead`."""
    if return_lse or dropout_p:
        raise ValueError("the paged decode kernel returns neither the log-sum-exp nor dropout; read the pages "
                         "with read='pages' (FlexAttention) for those")
    # imports triton: only when a cache reads this way
    from blockloop.nn.paged_decode import default_splits, paged_decode_attention

    return paged_decode_attention(q, k, v, read.table, read.reserved, read.query, read.key_valid,
                                  page_size=read.page_size, scale=scale, local=read.local, window=read.window,
                                  splits=default_splits(q.shape[0] * k.shape[1], read.processors))


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two attentions of the same queries over disjoint key sets into the one over their union.

    With Z = exp(lse), softmax over the union weights the two partial outputs by Z_a / (Z_a + Z_b) =
    sigmoid(lse_a - lse_b), so this is exactly one softmax over both key sets. A side with no visible key
    (lse = -inf) gets weight 0; rows empty on both sides stay zero.
    """
    weight = torch.sigmoid(lse_a - lse_b).nan_to_num(1.0).unsqueeze(-1)
    out = weight.to(out_a.dtype) * out_a + (1 - weight).to(out_b.dtype) * out_b
    return out, torch.logaddexp(lse_a, lse_b)


def _dense_mask(
    q: Tensor, k: Tensor, causal: bool, mask: Tensor | None, mask_mod: MaskMod | None
) -> Tensor | None:
    """The boolean mask as a tensor broadcastable to (B, H, Tq, Tk), or None for no mask."""
    tq, tk = q.shape[-2], k.shape[-2]
    if causal:
        mask_mod = causal_mask_mod(tk - tq)
    if mask_mod is not None:
        b = torch.arange(q.shape[0], device=q.device)[:, None, None, None]
        h = torch.arange(q.shape[1], device=q.device)[None, :, None, None]
        qi = torch.arange(tq, device=q.device)[None, None, :, None]
        ki = torch.arange(tk, device=q.device)[None, None, None, :]
        return mask_mod(b, h, qi, ki).expand(q.shape[0], q.shape[1], tq, tk)
    return mask


def _eager(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    groups = hq // hkv
    # Grouped-query attention without copying K/V: the G query heads of each key/value head become G * Tq
    # query rows against that head's keys (query head h uses key/value head h // G).
    qg = q.reshape(b, hkv, groups * tq, q.shape[-1])
    # Softmax in at least float32: bf16 scores lose the small weights.
    scores = (at_least_fp32(qg @ k.transpose(-2, -1)) * scale).view(b, hkv, groups, tq, tk)
    if mask is not None:
        scores = scores.masked_fill(~_grouped_mask(mask, hkv, groups), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows with no visible key have lse = -inf; give them zero weights instead of NaNs.
    weights = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(scores.dtype).min))
    weights = weights.nan_to_num(0.0).view(b, hkv, groups * tq, tk)
    out = (weights.to(v.dtype) @ v).view(b, hq, tq, v.shape[-1]).to(q.dtype)
    return out, lse.view(b, hq, tq)


def _grouped_mask(mask: Tensor, hkv: int, groups: int) -> Tensor:
    """A mask broadcastable to ``(B, Hq, Tq, Tk)`` as one broadcastable to ``(B, Hkv, G, Tq, Tk)``."""
    mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return mask.unsqueeze(2) if mask.shape[1] == 1 else mask.unflatten(1, (hkv, groups))


def _sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    mask: Tensor | None,
    mask_mod: MaskMod | None,
    scale: float,
    dropout_p: float,
) -> Tensor:
    groups = q.shape[1] // k.shape[1]
    tq, tk = q.shape[-2], k.shape[-2]
    if causal and tq != tk:
        # SDPA's is_causal aligns the diagonal top-left; a cache needs it bottom-right.
        causal, mask = False, _dense_mask(q, k, True, None, None)
    elif mask_mod is not None:
        mask = _dense_mask(q, k, False, None, mask_mod)
    shape = (*q.shape[:-1], v.shape[-1])
    enable_gqa = groups > 1
    if mask is not None and enable_gqa and not _sdpa_takes_grouped_keys_with_a_mask(q):
        # Each key/value head's G query heads become G * Tq query rows against its own keys (as _eager does).
        q = q.reshape(q.shape[0], k.shape[1], groups * tq, q.shape[-1])
        mask, enable_gqa = _folded_mask(mask, k.shape[1], groups, tq), False
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=enable_gqa
    )
    if mask is not None and not q.is_cpu:
        # Some GPU kernels return NaN for rows that see no key; the contract is zeros. SDPA's CPU kernels (math
        # and flash) already give zeros (its safe softmax, torch >= 2.5), so a CPU decode step skips the check.
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out.reshape(shape)


def _sdpa_takes_grouped_keys_with_a_mask(q: Tensor) -> bool:
    """SDPA's CPU kernel reads grouped K/V (``enable_gqa``) under a mask as they are. On a GPU flash takes grouped
    K/V but no mask and the memory-efficient kernel a mask but no grouping, and SDPA's default order (flash,
    memory-efficient, math, cuDNN in torch 2.11 and 2.13) reaches its math kernel first, which copies K/V per query
    head (a decode step would copy the whole cache, then upcast it). On CPU the fold would cost a copy of the
    queries for nothing (at SmolLM2's decode shapes on 2 cores, 1.35x the time of an attention call at batch 1,
    the same from batch 8)."""
    return q.is_cpu


def _folded_mask(mask: Tensor, hkv: int, groups: int, tq: int) -> Tensor:
    """A mask broadcastable to ``(B, Hq, Tq, Tk)`` as one broadcastable to ``(B, Hkv, G * Tq, Tk)``, the query
    rows of key/value head ``j`` being query heads ``j*G .. j*G + G-1`` one after another (``q.reshape``'s order).
    A mask the same for every query head and row (a decode step's ``(B, 1, 1, S)``) stays a view; one that differs
    by query row is copied once per query head of a key/value head, over the dimensions it really has (an expanded
    one, a causal mask over every row and head, is narrowed back to size 1 first)."""
    grouped = _grouped_mask(mask, hkv, groups)  # (B | 1, Hkv | 1, G | 1, Tq | 1, Tk)
    grouped = grouped[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in grouped.stride()[:4])]
    if grouped.shape[2] == grouped.shape[3] == 1:
        return grouped.squeeze(2)
    b, h, tk = grouped.shape[0], grouped.shape[1], grouped.shape[-1]
    return grouped.expand(b, h, groups, tq, tk).reshape(b, h, groups * tq, tk)


def _flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    mask: Tensor | None,
    mask_mod: MaskMod | None,
    block_mask: BlockMask | None,
    scale: float,
    return_lse: bool,
) -> tuple[Tensor, Tensor | None]:
    """FlexAttention asks for the log-sum-exp only when the caller does: inductor cannot compile it on CPU (so no
    step reading through Flex compiled there), and a decode step has no use for it. A query row with no visible
    key comes out as zeros either way (FlexAttention's own rule, tested on CPU and CUDA)."""
    from torch.nn.attention import flex_attention as fa

    tq, tk = q.shape[-2], k.shape[-2]
    if causal:
        mask_mod = causal_mask_mod(tk - tq)
    elif mask is not None:
        dense = mask.expand(q.shape[0], q.shape[1], tq, tk)

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return dense[b, h, q_idx, kv_idx]

    if mask_mod is not None:
        block_mask = fa.create_block_mask(mask_mod, q.shape[0], q.shape[1], tq, tk, device=q.device)
    flex = _compiled_flex() if q.is_cuda else fa.flex_attention
    enable_gqa = q.shape[1] != k.shape[1]
    if not return_lse:
        return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa), None
    if hasattr(fa, "AuxRequest"):
        out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                        return_aux=fa.AuxRequest(lse=True))
        lse = aux.lse
    else:  # torch < 2.9
        out, lse = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True)
    lse = at_least_fp32(lse)
    return out.masked_fill((lse == float("-inf")).unsqueeze(-1), 0.0), lse


_COMPILED_FLEX = None


def _compiled_flex() -> Callable[..., object]:
    """FlexAttention is only fused when compiled; compile it once per process."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX
