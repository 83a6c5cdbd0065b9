"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), each row with its own parameters
and random stream, all batched on device."""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (the "lowbias32" finaliser) on int64 tensors; wraps like uint32."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """Uniforms in (0, 1) of shape ``(N, vocab)`` that depend only on each row's ``(seed, counter)``.

    A counter-based generator instead of a stateful one: a request's random stream is a function of its
    own seed and how many tokens it has sampled, so it does not change with the batch it shares, its
    slot, or when it joined, and the whole batch draws in one kernel without host work.
    """
    ids = torch.arange(vocab, device=seed.device, dtype=torch.long)
    row = _hash32(_hash32(seed) ^ (counter * 0x9E3779B9))
    bits = _hash32(row[:, None] ^ _hash32(ids + 0x632BE5AB)[None, :])
    return (bits.double() + 0.5) / 2.0**32


def sample_rows(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    seed: Tensor,
    counter: Tensor,
    *,
    filtered: bool = True,
) -> Tensor:
    """One token per row of ``logits (N, V)`` with each row's own parameters, all on device.

    ``temperature (N,)`` (0 = greedy), ``top_k (N,)`` (0 = off), ``top_p (N,)`` (1 = off), ``seed`` and
    ``counter (N,)`` key the row's noise (:func:`counter_uniform`). Sampling is the Gumbel-max trick:
    argmax of ``logits / T + Gumbel noise`` draws from ``softmax(logits / T)`` restricted to the tokens
    that survive top-k/top-p. ``filtered=False`` skips the sort when no row uses top-k/top-p.
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    if filtered:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)
        probs = sorted_logits.softmax(dim=-1)
        drop_sorted = (rank[None, :] >= top_k.masked_fill(top_k <= 0, scaled.shape[-1])[:, None]) | (
            (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        )
        drop_sorted[:, 0] = False
        scaled = scaled.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    gumbel = -torch.log(-torch.log(counter_uniform(seed, counter, scaled.shape[-1]))).float()
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
