"""Self-attention that also attends to keys/values placed before the sequence's own: one module, two papers.

With prefix keys/values ``K_p, V_p`` (``P`` of them, no queries of their own) the output is

    softmax(q [K_p; K]^T * scale + mask) [V_p; V]

where q, K, V are exactly :class:`~blockloop.models.decoder.SelfAttention`'s (projection, q/k norms,
rotary, cache writes) and so are the score scale (the config's ``attn_scale``) and dropout. The prefix is
never written to a KV cache. Its two uses:

* the Relaxed Recursive Transformer's prefix relaxation (Bae et al. 2024, appendix K): learned keys/values
  per depth position, with no position (no rotary), visible to every query;
* the staircase family (Ju et al. 2022, section 3.2.2): the Cached Staircase's cache, the Feedback
  Transformer's memory and Transformer-XL's memory enter self-attention "only when computing keys and
  values" (:meth:`PrefixSelfAttention.keys_values`), rotated by the caller to their stream positions; a
  window mask says which of them each query sees.
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockloop.models.decoder import SelfAttention, merge_heads
from blockloop.nn.attention import attention
from blockloop.nn.kv_cache import LayerStep
from blockloop.nn.masks import MaskMod, own_keys_mask, with_visible_prefix

KV = tuple[Tensor, Tensor]


class PrefixSelfAttention(SelfAttention):
    """SelfAttention over ``[prefix keys/values; own keys/values]``; same parameters as SelfAttention."""

    def keys_values(self, x: Tensor) -> KV:
        """Un-rotated keys and values ``(B, H_kv, T, D)`` of (already normed) states ``x``.

        Goes through :meth:`project` with a zero-width rotation, so whatever SelfAttention does to keys
        (e.g. a key norm) applies to these states too; the queries it also computes are dropped.
        """
        no_rotation = x.new_zeros(x.shape[1], 0)
        _, k, v = self.project(x, no_rotation, no_rotation)
        return k, v

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        *,
        kv: LayerStep | None = None,
        mask: Tensor | None = None,
        mask_mod: MaskMod | None = None,
        prefix: KV | None = None,
    ) -> Tensor:
        """``prefix``: keys and values ``(B or 1, H_kv, P, D)`` placed before this call's own keys/values.

        With a prefix, ``mask`` covers the prefix keys then the own keys (``(..., T, P + K)``); without a
        mask every query sees the whole prefix and its own keys causally. Without a prefix this is
        SelfAttention.
        """
        if prefix is None:
            return super().forward(x, cos, sin, kv=kv, mask=mask, mask_mod=mask_mod)
        if mask_mod is not None:
            raise ValueError("attention over a prefix takes a dense mask (prefix keys first), not a mask_mod")
        q, k, v = self.project(x, cos, sin, kv)
        pk, pv = (t.expand(q.shape[0], -1, -1, -1).to(k.dtype) for t in prefix)
        if mask is None:
            mask = with_visible_prefix(own_keys_mask(q.shape[2], k.shape[2], self.causal, q.device), pk.shape[2])
        dropout = self.dropout if self.training else 0.0
        out = attention(q, torch.cat((pk, k), 2), torch.cat((pv, v), 2), mask=mask, scale=self.scale, dropout_p=dropout)
        return self.proj(merge_heads(out))
