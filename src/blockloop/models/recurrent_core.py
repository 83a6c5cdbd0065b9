"""The shared transformer core of the staircase family, and what lets it attend to states it does not compute.

Staircase, Ladder and their baselines all run one :class:`~blockloop.models.decoder.TransformerStack`
(the "core", Ju et al. 2022, section 3.1) several times. Two things are added to the plain stack:

* :class:`~blockloop.models.prefix_attention.PrefixSelfAttention` is SelfAttention whose keys/values may
  start with precomputed ones: the Cached Staircase's cache, the Feedback Transformer's memory and
  Transformer-XL's memory enter the self-attention sublayer "only when computing keys and values"
  (section 3.2.2), with no queries and no feed-forward;
* :func:`window_mask` is the one mask they share: a query sees the prefix keys that are valid, and causal
  keys of its own window (and, with ``span``, only the nearest ones), and always itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockloop.models.decoder import Block, TransformerStack
from blockloop.models.prefix_attention import KV, PrefixSelfAttention
from blockloop.nn.rope import apply_rope


def build_core(config: object) -> TransformerStack:
    """The core: the plain stack's layers (same parameter names) with :class:`PrefixSelfAttention`, no final norm."""
    return TransformerStack(config, final_norm=False, attention=PrefixSelfAttention)


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
