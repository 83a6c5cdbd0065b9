"""Self-speculative decoding of looped models, batched: draft with the first loops, verify with the rest.

A Recursive Transformer trained with the early-exit loss (RRT section 3.7) holds a cheap draft model inside
itself: its first ``draft_loops`` loops read through the shared final norm and head. One decode step of
:class:`Speculator` is one round for every busy row of a continuous batch (the first rows, ``prefix_steps``):

1. draft: the row's pending token, then up to ``k`` drafted tokens, each run through loops
   ``0 .. draft_loops - 1`` only, one token at a time (their keys/values go to those loops' cache entries),
   each draft drawn from the exit logits of the last draft loop;
2. verify: ONE pass of the remaining loops over those ``k + 1`` hidden states at once. The draft *is* the
   first loops of this pass, so their states and K/V are reused, not recomputed;
3. accept (:func:`~blockloop.serve.sampling.speculative_accept`): the longest prefix of drafts the rule
   keeps (greedy: equal to the full model's argmax) plus one token from the full model (the corrected one,
   or a bonus one after ``k`` kept drafts), so each round emits 1 .. k + 1 tokens with exactly the full
   model's output (greedy) or distribution (sampling);
4. roll back by not moving: the row's next cache slot advances by the emitted count; the entries of rejected
   drafts beyond it are overwritten by the next round before any query can see them (a query sees only
   slots at or before its own), so nothing is copied or cleared. Sliding-window layers' rolling caches are
   allocated with ``k`` spare ring entries (``rollback``) so that rejected drafts, which take ring entries too,
   never push out a slot a later query still sees.

Rows are independent: each has its own slot, position, draft length and random streams (keyed by its
request's seed and its round count), and a request that does not speculate (``SamplingParams(speculate=0)``)
shares the batch as an ordinary full-depth step whose token the engine samples as usual. The engine sees a
runner that emits tokens itself (``Runner.emits``, ``StepOutput.emitted``). Shapes are static (``k`` drafts
for every row; a row asking for fewer keeps at most its own number), except with ``adaptive``, where each
row's ``k`` grows by one after a round that kept all its drafts and shrinks by one otherwise, and a round
drafts the longest of them. The host learns that length without waiting for the device: each round ends by
copying it to host memory asynchronously, and the next round takes the newest copy that has arrived (on a
GPU running ahead, a round or so late; on the CPU, the last round's). The round itself
(:meth:`Speculator.round`) has static shapes for a given draft length, so compiled it is one graph per length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from blockloop.errors import BlockloopError
from blockloop.models.recursive import RecursiveDecoder
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners.base import StepOutput, over_rows, static_state
from blockloop.serve.runners.decoder import DecodeState
from blockloop.serve.sampling import SlotSampling, sample_probs, speculative_accept, substream


@dataclass(frozen=True)
class Speculation:
    """Draft ``k`` tokens per round with the first ``draft_loops`` loops (``adaptive``: per-row k, see the
    module docstring)."""

    k: int = 4
    draft_loops: int = 1
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.k < 1:
            raise BlockloopError(f"speculation needs k >= 1 draft tokens, got {self.k}")
        if self.draft_loops < 1:
            raise BlockloopError(f"draft_loops must be >= 1, got {self.draft_loops}")


@dataclass
class SpeculativeState:
    """Per row: the token fed next, its draft length (-1: not set yet), the rounds it ran, and per round
    (at the cache slot of the token it started from) the tokens it emitted and the drafts it offered."""

    pending: Tensor
    k_now: Tensor
    rounds: Tensor
    emitted_log: Tensor
    drafted_log: Tensor


class Speculator:
    """The speculative decode step of a :class:`~blockloop.serve.runners.recursive.RecursiveRunner` (which
    owns the cache and each row's next slot and position, :class:`DecodeState`)."""

    def __init__(self, model: RecursiveDecoder, speculation: Speculation) -> None:
        if not speculation.draft_loops < model.config.loops:
            loops = model.config.loops
            if loops == 1:
                raise BlockloopError("this recursive model runs 1 loop, so no shallower draft of it exists to "
                                     "speculate with; leave out --speculate")
            raise BlockloopError(f"the draft (--draft-loops, draft_loops) runs {speculation.draft_loops} loops, not fewer "
                                 f"than the model's {loops}: give {'1' if loops == 2 else f'1 to {loops - 1}'}")
        self.model, self.speculation = model, speculation

    def allocate(self, n_slots: int, max_len: int) -> None:
        longs = lambda *shape: torch.zeros(shape, dtype=torch.long, device=self.model.embed.weight.device)  # noqa: E731
        self.state = SpeculativeState(longs(n_slots), longs(n_slots) - 1, longs(n_slots), longs(n_slots, max_len),
                                      longs(n_slots, max_len))
        static_state(self.state.emitted_log, self.state.drafted_log)  # a round logs into them in place
        self.k_hint = self.speculation.k  # the draft length of the next adaptive round, as the host last heard it
        self._k_arrived: torch.cuda.Event | None = None
        self._k_host: Tensor | None = None

    def start(self, rows: int | slice) -> None:
        """A new request in ``rows``: its draft length comes from its sampling parameters, its rounds from 0."""
        self.state.k_now[rows], self.state.rounds[rows] = -1, 0
        self.k_hint = self.speculation.k  # its first round may draft up to the runner's k

    def check(self, sampling: SamplingParams) -> None:
        if sampling.speculate is not None and sampling.speculate > self.speculation.k:
            raise BlockloopError(
                f"a request may draft at most the runner's k = {self.speculation.k} tokens, asked for {sampling.speculate}"
            )

    def step(
        self, decode: DecodeState, tokens: Tensor, sampling: SlotSampling, run: Callable[..., StepOutput] | None = None
    ) -> StepOutput:
        """One draft-verify-accept round for every row (see the module docstring), through ``run`` (this
        speculator's :meth:`round`, or a compiled form of it). ``tokens`` holds the engine's token for rows it
        sampled and -1 for speculating rows, which continue from their own."""
        k = self._draft_length() if self.speculation.adaptive else self.speculation.k
        out = (run or self.round)(decode, tokens, sampling, k)
        if self.speculation.adaptive:
            self._send_draft_length()
        return out

    def _draft_length(self) -> int:
        if self._k_arrived is not None and self._k_arrived.query():  # the newest copy has landed: no wait
            self.k_hint = int(self._k_host)
        return min(max(self.k_hint, 1), self.speculation.k)

    def _send_draft_length(self) -> None:
        """Start copying the longest draft length a row wants next to the host, without waiting for it."""
        wanted = self.state.k_now.max()
        if not wanted.is_cuda:
            self.k_hint = int(wanted)  # on the CPU the value is already there
            return
        if self._k_host is None:
            self._k_host = torch.zeros((), dtype=wanted.dtype).pin_memory()
            self._k_arrived = torch.cuda.Event()
        self._k_host.copy_(wanted, non_blocking=True)
        self._k_arrived.record()

    @torch.no_grad()
    def round(self, decode: DecodeState, tokens: Tensor, sampling: SlotSampling, k: int) -> StepOutput:
        """The round itself for the first ``len(tokens)`` rows (the others keep their state), drafting ``k``
        positions: static shapes for a given ``k`` and row count (no host read)."""
        m, config, spec, state = self.model, self.model.config, self.speculation, self.state
        rows, vocab = len(tokens), config.vocab_size
        cache = decode.prefixes[rows]
        requested = torch.where(sampling.speculate[:rows] < 0, spec.k, sampling.speculate[:rows])
        k_now = torch.where(state.k_now[:rows] < 0, requested, state.k_now[:rows])
        speculating = requested > 0

        offsets = torch.arange(k + 1, device=tokens.device)
        slots = (decode.next_slot[:rows, None] + offsets).clamp_max(cache.max_len - 1)
        positions = (decode.next_position[:rows, None] + offsets).clamp_max(config.context_length - 1)
        first = torch.where(tokens >= 0, tokens, state.pending[:rows])
        x, drafted, draft_probs = self._draft(cache, first, slots, positions, sampling)

        step = StepContext(cache, slots, positions)  # verification: the other loops over all k + 1
        inputs = m.loop_inputs(x, step)
        for loop in range(spec.draft_loops, config.loops):
            x = m.run_loop(x, loop, inputs, step=step)
        logits = m.exit_logits(x)
        limit = torch.where(speculating, k_now, 0).clamp_max(k)
        accepted, token = speculative_accept(sampling.probs(logits[..., :vocab]), draft_probs, drafted, limit,
                                             sampling.seed[:rows], state.rounds[:rows], greedy=sampling.greedy)

        emitted = torch.where(offsets < accepted[:, None], F.pad(drafted, (0, 1)), -1)
        emitted = emitted.scatter(1, accepted[:, None], token[:, None])
        emitted = F.pad(torch.where(speculating[:, None], emitted, -1), (0, spec.k - k), value=-1)
        advance = accepted + 1
        index = torch.arange(rows, device=tokens.device)
        state.emitted_log[index, slots[:, 0]] = advance
        state.drafted_log[index, slots[:, 0]] = limit
        decode.next_slot = over_rows(decode.next_slot[:rows] + advance, decode.next_slot)
        decode.next_position = over_rows(decode.next_position[:rows] + advance, decode.next_position)
        state.pending, state.rounds = over_rows(token, state.pending), over_rows(state.rounds[:rows] + 1, state.rounds)
        if spec.adaptive:
            k_now = torch.where(accepted == limit, k_now + 1, k_now - 1).clamp_min(1)
        state.k_now = over_rows(torch.minimum(k_now, requested), state.k_now)
        return StepOutput(logits[:, 0], ~speculating, emitted)

    def _draft(
        self, cache: DecoderCache, token: Tensor, slots: Tensor, positions: Tensor, sampling: SlotSampling
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Run ``token`` and then each drafted token through the draft loops, one position at a time, at
        ``slots`` / ``positions (rows, k + 1)``: the hidden states ``(rows, k + 1, d)`` the verification goes
        on from, and the ``k`` drafts with the distributions they were drawn from ``(rows, k, V)``."""
        m, spec, rounds = self.model, self.speculation, self.state.rounds[: len(token)]
        seed = substream(sampling.seed[: len(token)], 1)
        hiddens, drafts, draft_probs = [], [], []
        for j in range(slots.shape[1]):
            step = StepContext(cache, slots[:, j : j + 1], positions[:, j : j + 1])
            x = m.embed_input(token[:, None], positions[:, j : j + 1])
            inputs = m.loop_inputs(x, step)
            for loop in range(spec.draft_loops):
                x = m.run_loop(x, loop, inputs, step=step)
            hiddens.append(x)
            if j < slots.shape[1] - 1:  # the last position is only verified
                q = sampling.probs(m.exit_logits(x)[..., : m.config.vocab_size])
                token = sample_probs(q[:, 0], seed, rounds * (spec.k + 1) + j, greedy=sampling.greedy)
                drafts.append(token)
                draft_probs.append(q)
        return torch.cat(hiddens, 1), torch.stack(drafts, 1), torch.cat(draft_probs, 1)

    def rounds_of(self, row: int, start: int, n_tokens: int) -> list[tuple[int, int]]:
        """``(tokens emitted, drafts offered)`` of each round that produced the ``n_tokens`` tokens decoded in
        ``row`` from cache slot ``start`` on (a request's output tokens 2.., the first coming from prefill).
        Read it once the request has finished, before its row is prefilled again (a host sync)."""
        emitted, drafted = self.state.emitted_log[row].tolist(), self.state.drafted_log[row].tolist()
        rounds, slot, covered = [], start, 0
        while covered < n_tokens:
            if emitted[slot] < 1:
                raise BlockloopError(f"no speculative round started at slot {slot} of row {row}; read it before reuse")
            rounds.append((emitted[slot], drafted[slot]))
            covered, slot = covered + emitted[slot], slot + emitted[slot]
        return rounds
