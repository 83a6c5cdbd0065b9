"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), each row with its own parameters
and random stream, all batched on device; and the speculative acceptance rule, which keeps a target
model's distribution exactly while tokens are guessed by a cheaper draft."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from blockloop.serve.requests import SamplingParams

_MASK32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (the "lowbias32" finaliser) on int64 tensors; wraps like uint32."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _word(seed: Tensor) -> Tensor:
    """A request's int64 seed as one 32-bit word: the seed itself below 2**32, its high word mixed in above (or
    below 0), so that seeds differing by a multiple of 2**32 do not share a stream."""
    high = seed >> 32
    return (seed & _MASK32) ^ torch.where(high != 0, _hash32(high ^ 0x27D4EB2F), 0)


def counter_uniform(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """Uniforms in (0, 1) of shape ``(N, vocab)`` that depend only on each row's ``(seed, counter)``.

    A counter-based generator instead of a stateful one: a request's random stream is a function of its
    own seed and how many tokens it has sampled, so it does not change with the batch it shares, its
    slot, or when it joined, and the whole batch draws in one kernel without host work.
    """
    ids = torch.arange(vocab, device=seed.device, dtype=torch.long)
    row = _hash32(_hash32(_word(seed)) ^ (counter * 0x9E3779B9))
    bits = _hash32(row[:, None] ^ _hash32(ids + 0x632BE5AB)[None, :])
    return (bits.double() + 0.5) / 2.0**32


def substream(seed: Tensor, stream: int) -> Tensor:
    """A seed for the ``stream``-th extra random stream of requests seeded ``seed`` (speculative drafting and
    acceptance), unrelated to every request's own stream and to each other."""
    return _hash32(_word(seed) + 0x5BD1E995 * stream)


def gumbel(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """``(N, vocab)`` Gumbel noise of each row's ``(seed, counter)`` stream: argmax of scores plus it samples
    softmax(scores) (the Gumbel-max trick)."""
    return -torch.log(-torch.log(counter_uniform(seed, counter, vocab))).float()


def filter_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, *, filtered: bool = True) -> Tensor:
    """``logits (N, V)`` divided by each row's temperature, with the tokens top-k / top-p drop set to -inf:
    softmax of the result is the distribution a sampled row draws from. ``filtered=False`` skips the sort
    when no row uses top-k/top-p."""
    scaled = logits.float() / temperature.clamp_min(1e-6)[:, None]
    if not filtered:
        return scaled
    # stable: among tied logits the lowest id ranks first, the token argmax (greedy) picks, so top_k=1 is greedy
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    beyond_k = rank[None, :] >= top_k.masked_fill(top_k <= 0, scaled.shape[-1])[:, None]
    # top-k first, then top-p over what it kept, renormalised (as Hugging Face's warpers and vLLM apply both)
    probs = sorted_logits.masked_fill(beyond_k, float("-inf")).softmax(dim=-1)
    # top_p = 1 is "off": a float32 running sum can reach 1.0 before the tail, which would drop its tokens
    nucleus = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1)[:, None]
    drop_sorted = beyond_k | nucleus
    drop_sorted[:, 0] = False
    return scaled.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


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
    that survive top-k/top-p.
    """
    greedy = logits.argmax(dim=-1)
    scaled = filter_logits(logits, temperature, top_k, top_p, filtered=filtered)
    sampled = (scaled + gumbel(seed, counter, scaled.shape[-1])).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


def sample_probs(probs: Tensor, seed: Tensor, counter: Tensor, *, greedy: bool = False) -> Tensor:
    """One token per row of ``probs (N, V)`` (unnormalised weights are fine; a one-hot row is a greedy pick).
    ``greedy``: every row is one-hot, so skip the noise."""
    if greedy:
        return probs.argmax(dim=-1)
    return (probs.log() + gumbel(seed, counter, probs.shape[-1])).argmax(dim=-1)


@dataclass
class SlotSampling:
    """Every engine slot's sampling parameters and how many tokens the engine has sampled for it, on device.

    The engine's own; a runner that chooses tokens itself (speculative decoding) reads it through
    ``Runner.sampling``. ``speculate`` is the request's draft length (-1: the runner's default).
    ``filtered`` / ``greedy`` say whether any running request uses top-k/top-p and whether all are greedy
    (set by the engine each window, so that no step reads them back from the device).
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    seed: Tensor
    counter: Tensor
    speculate: Tensor
    filtered: bool = True
    greedy: bool = False

    @classmethod
    def empty(cls, n_slots: int, device: torch.device) -> SlotSampling:
        longs = (torch.zeros(n_slots, dtype=torch.long, device=device) for _ in range(4))
        return cls(torch.zeros(n_slots, device=device), next(longs), torch.ones(n_slots, device=device), *longs)

    def set(self, slot: int, s: SamplingParams, sampled: int = 0) -> None:
        """Give ``slot`` a request's parameters and its count of tokens sampled so far (0, or where a preempted
        request's stream stopped, so it samples the same tokens as if it had never been)."""
        self.temperature[slot], self.seed[slot], self.counter[slot] = s.temperature, s.seed, sampled
        self.top_k[slot], self.top_p[slot] = s.top_k or 0, s.top_p if s.top_p is not None else 1.0
        self.speculate[slot] = -1 if s.speculate is None else s.speculate

    def sample(self, logits: Tensor) -> Tensor:
        """One token for each of the first ``len(logits)`` slots, from its own stream at its own count."""
        if self.greedy:
            return logits.argmax(dim=-1)
        rows = len(logits)
        return sample_rows(logits, self.temperature[:rows], self.top_k[:rows], self.top_p[:rows], self.seed[:rows],
                           self.counter[:rows], filtered=self.filtered)

    def probs(self, logits: Tensor) -> Tensor:
        """The distributions the first ``N`` slots sample from, for ``logits (N, T, V)``: softmax of the
        filtered logits, one-hot on the argmax for greedy rows (so the acceptance rule below is greedy
        verification for them)."""
        one_hot = torch.zeros_like(logits, dtype=torch.float).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        if self.greedy:
            return one_hot
        rows, length, vocab = logits.shape
        repeat = lambda t: t[:rows, None].expand(rows, length).reshape(-1)  # noqa: E731
        scaled = filter_logits(logits.flatten(0, 1), repeat(self.temperature), repeat(self.top_k), repeat(self.top_p),
                               filtered=self.filtered).view(rows, length, vocab)
        return torch.where((self.temperature[:rows] > 0)[:, None, None], scaled.softmax(-1), one_hot)


def speculative_accept(
    target: Tensor, draft: Tensor, drafted: Tensor, limit: Tensor, seed: Tensor, counter: Tensor, *, greedy: bool = False
) -> tuple[Tensor, Tensor]:
    """The standard speculative acceptance rule (Leviathan et al. 2023; Chen et al. 2023), batched.

    ``drafted (N, K)`` tokens were drawn from ``draft (N, K, V)``; ``target (N, K + 1, V)`` is the
    distribution the model samples from after each prefix (the last one after all K). Draft ``i`` is kept
    with probability ``min(1, p(x) / q(x))``, in order, and at most ``limit (N,)`` of them; the next token
    comes from ``max(0, p - q)`` (renormalised) where a draft was rejected, else from ``p`` (all kept, or
    cut by the limit). The emitted tokens are then distributed exactly as sampling the target one token at
    a time. Greedy rows (one-hot ``p`` and ``q``) keep the drafts equal to the target's argmax and then take
    its argmax (``greedy``: all rows are, so no noise is drawn). Returns how many drafts each row keeps and
    its next token. Randomness comes from the rows' ``(seed, counter)`` streams (two of them, distinct from
    the engine's).
    """
    rows, k = drafted.shape
    index = torch.arange(k, device=drafted.device)
    p_drafted = target[:, :k].gather(-1, drafted[..., None])[..., 0]
    q_drafted = draft.gather(-1, drafted[..., None])[..., 0]
    uniform = 0.5 if greedy else counter_uniform(substream(seed, 2), counter, k).float()
    keep = (uniform * q_drafted < p_drafted) & (index < limit[:, None])
    accepted = keep.long().cumprod(1).sum(1)
    p_next = target[torch.arange(rows, device=drafted.device), accepted]
    if k:
        q_next = draft[torch.arange(rows, device=drafted.device), accepted.clamp_max(k - 1)]
        p_next = torch.where((accepted < limit)[:, None], (p_next - q_next).clamp_min(0), p_next)
    return accepted, sample_probs(p_next, substream(seed, 3), counter, greedy=greedy)
