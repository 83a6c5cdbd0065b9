"""The shared transformer core of the staircase family, and what lets it attend to states it does not compute.

Staircase, Ladder and their baselines all run one :class:`~blockloop.models.decoder.TransformerStack`
(the "core", Ju et al. 2022, section 3.1) several times. Two things are added to the plain stack:

* :class:`~blockloop.models.prefix_attention.PrefixSelfAttention` is SelfAttention whose keys/values may
  start with precomputed ones: the Cached Staircase's cache, the Feedback Transformer's memory and
  Transformer-XL's memory enter the self-attention sublayer "only when computing keys and values"
  (section 3.2.2), with no queries and no feed-forward;
* :func:`blockloop.nn.masks.window_mask` is the one mask they share: a query sees the prefix keys that are
  valid, and causal keys of its own window (and, with ``span``, only the nearest ones), and always itself.
"""

from __future__ import annotations

from torch import Tensor

from blockloop.config import TransformerShape
from blockloop.models.decoder import Block, TransformerStack
from blockloop.models.prefix_attention import KV, PrefixSelfAttention
from blockloop.nn.rope import apply_rope


def build_core(config: TransformerShape) -> TransformerStack:
    """The core: the plain stack's layers (same parameter names) with :class:`PrefixSelfAttention`, no final norm."""
    return TransformerStack(config.stack(), final_norm=False, attention=PrefixSelfAttention)


def prefix_kv(block: Block, states: Tensor) -> KV:
    """Keys/values layer ``block`` reads from ``states`` (normed by the layer's own pre-attention norm)."""
    return block.attn.keys_values(block.norm1(states))


def rotate_prefix(kv: KV, cos: Tensor, sin: Tensor) -> KV:
    """Rotate cached keys to the positions they have in the current window (values have no position)."""
    return apply_rope(kv[0], cos, sin), kv[1]
