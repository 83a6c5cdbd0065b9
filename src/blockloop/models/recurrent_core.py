"""The shared transformer core of the staircase family, and what lets it attend to states it does not compute.

Staircase, Ladder and their baselines all run one :class:`~blockloop.models.decoder.TransformerStack`
(the "core", Ju et al. 2022, section 3.1) several times. Two things are added to the plain stack:

* :class:`PrefixAttention` is SelfAttention whose keys/values may start with precomputed ones: the Cached
  Staircase's cache, the Feedback Transformer's memory and Transformer-XL's memory enter the self-attention
  sublayer "only when computing keys and values" (section 3.2.2), with no queries and no feed-forward;
* :func:`window_mask` is the one mask they share: a query sees the prefix keys that are valid, and causal
  keys of its own window (and, with ``span``, only the nearest ones), and always itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockloop.config import TransformerShape
from blockloop.models.decoder import Block, SelfAttention, TransformerStack, merge_heads
from blockloop.nn.attention import attention
from blockloop.nn.rope import apply_rope

KV = tuple[Tensor, Tensor]


class PrefixAttention(SelfAttention):
    """Self-attention over ``[prefix keys/values, own keys/values]``; same parameters as SelfAttention."""

    def keys_values(self, x: Tensor) -> KV:
        """Un-rotated keys and values ``(B, H_kv, T, D)`` of (already normed) states ``x``.

        Goes through :meth:`project` with a zero-width rotation, so whatever SelfAttention does to keys
        (e.g. a key norm) applies to cached states too; the queries it also computes are dropped.
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
        cache: object = None,
        slots: Tensor | None = None,
        mask: Tensor | None = None,
        prefix: KV | None = None,
    ) -> Tensor:
        """``prefix`` holds rotated keys and values placed before this call's own; ``mask`` covers both."""
        q, k, v = self.project(x, cos, sin, cache, slots)
        if prefix is not None:
            k, v = torch.cat((prefix[0].to(k.dtype), k), dim=2), torch.cat((prefix[1].to(v.dtype), v), dim=2)
        dropout = self.dropout if self.training else 0.0
        out = attention(q, k, v, causal=self.causal and mask is None, mask=mask, dropout_p=dropout)
        return self.proj(merge_heads(out))


def build_core(config: TransformerShape) -> TransformerStack:
    """The core: the plain stack's layers (same parameter names) with :class:`PrefixAttention`, no final norm."""
    return TransformerStack(config.stack(), final_norm=False, attention=PrefixAttention)


def prefix_kv(block: Block, states: Tensor) -> KV:
    """Keys/values layer ``block`` reads from ``states`` (normed by the layer's own pre-attention norm)."""
    return block.attn.keys_values(block.norm1(states))


def rotate_prefix(kv: KV, cos: Tensor, sin: Tensor) -> KV:
    """Rotate cached keys to the positions they have in the current window (values have no position)."""
    return apply_rope(kv[0], cos, sin), kv[1]


def window_mask(prefix_valid: Tensor, valid: Tensor, span: int | None = None) -> Tensor:
    """``(B, 1, T, P + T)`` boolean mask for ``T`` queries over ``P`` prefix keys then their own ``T`` keys.

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
