"""Serving Recursive Transformers: sequence-wise like a decoder, or with continuous depth-wise batching and
early exit (Bae et al. 2024, section 2.4 and appendix N). The paper measures only an oracle exit (below) and
leaves confidence-based exit to future work (appendix A); ``max_prob`` and ``entropy`` are blockloop's
confidence rules, served for real.

:class:`RecursiveRunner` without an exit rule is the decoder's runner. Sequence-wise serving runs all ``B`` loops of a
token before the next. Here one decode step runs ONE loop of the shared block over every row, each row at its own
loop (its per-loop LoRA gathered by loop index, :meth:`RecursiveDecoder.run_loop` with a ``(rows,)`` loop tensor,
over a :class:`~blockloop.serve.runners.looped_cache.LoopedCache`, or its paged form with ``paging``, each row's
loop read in place). After loop ``k`` a row's exit
logits (shared final norm + head, section 3.7) are scored by an :class:`ExitRule`; a row whose rule
fires, or that finished the last loop, emits its token, and starts the next token's loop 0 at the very
next step, while the other rows go on to their next loop. With early exits, tokens cost fewer loops
and the freed depth is used at once by the next token: that is the throughput the paper simulates.

Owed KV entries: a token that exits after loop ``k`` never computes keys/values for loops ``k+1 ..
B-1``, which later tokens attend to at those loops. We copy the exit loop's K/V of the token into the
deeper loops' cache entries (the "copy the exit state" choice, as in depth-adaptive transformers / CALM's
state propagation); it is cheap (one slot per layer and loop) and keeps every loop's cache dense. Its
quality effect is measured as greedy agreement with no-exit decoding (``benchmarks/results``).

Oracle exit (section 3.8, appendix N): ``ExitRule("oracle")`` reproduces the paper's simulation. Every token
still runs every loop (so the cache and the output are exactly no-exit greedy decoding), but the wrapper
records, per token, the earliest loop whose greedy prediction equals the final loop's: the loop it *would*
have left after. Those exit trajectories (:meth:`RecursiveRunner.exit_trajectory`) are then scheduled
by :mod:`blockloop.serve.exit_schedule`, which counts the steps a depth-wise batch would need against a
sequence-wise one, the paper's simulated speedup.

The engine drives this runner like any other: depth-wise, ``decode_step`` returns ``(logits, ready)``,
and the engine samples only rows that are ``ready`` (token -1 for the others).

With ``speculation`` (:mod:`blockloop.serve.runners.speculative`) the runner is sequence-wise but each step
is a self-speculative round: draft with the first loops, verify with the others in one pass, emit 1 .. k + 1
tokens per row, exactly the full model's output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from blockloop.errors import BlockloopError, check_context
from blockloop.models.recursive import RecursiveDecoder
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.paged_cache import KVPages
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners.base import StepOutput, over_rows, static_state
from blockloop.serve.runners.decoder import DecoderRunner, DecodeState
from blockloop.serve.runners.looped_cache import LoopedCache, PagedLoopedCache
from blockloop.serve.runners.paging import Paging
from blockloop.serve.runners.speculative import Speculation, Speculator

EXIT_RULES = ("none", "max_prob", "entropy", "oracle")


@dataclass(frozen=True)
class ExitRule:
    """When a token may leave after a loop: ``max_prob`` (top probability >= threshold) or ``entropy``
    (entropy in nats <= threshold) of that loop's exit logits, never before ``min_loops`` loops;
    ``none`` always runs every loop; ``oracle`` runs every loop too but records the earliest loop that
    agrees with the final one (the threshold is unused)."""

    kind: str = "max_prob"
    threshold: float = 0.9
    min_loops: int = 1

    def __post_init__(self) -> None:
        if self.kind not in EXIT_RULES:
            raise BlockloopError(f"unknown exit rule {self.kind!r}; choose one of {', '.join(EXIT_RULES)}")
        if self.min_loops < 1:
            raise BlockloopError(f"min_loops must be >= 1, got {self.min_loops}")
        # NaN never fires and a threshold outside the range fires always or never: a rule that means nothing.
        # (max_prob 0 fires at min_loops always: the exit of a fixed depth, kept as a deliberate setting.)
        t = self.threshold
        if self.kind == "max_prob" and not (isinstance(t, int | float) and 0 <= t <= 1):
            raise BlockloopError(f"the max_prob exit threshold is a probability in [0, 1], got {t!r}")
        if self.kind == "entropy" and not (isinstance(t, int | float) and 0 <= t < math.inf):
            raise BlockloopError(f"the entropy exit threshold is a finite number of nats >= 0, got {t!r}")

    @classmethod
    def parse(cls, text: str) -> ExitRule:
        """``--exit``'s ``RULE:THRESHOLD`` (``max_prob:0.9``, ``entropy:2.0``, ``none:0``) or ``oracle``."""
        kind, _, threshold = text.partition(":")
        if kind in ("none", "oracle"):  # rules that read no threshold: one given would be ignored, so refuse it
            if threshold.strip() not in ("", "0", "0.0"):
                raise BlockloopError(f"--exit {kind} reads no threshold, got {text!r}; give {kind} (or {kind}:0)")
            return cls(kind, 0.0)
        try:
            value = float(threshold)
        except ValueError:
            raise BlockloopError(f"--exit takes RULE:THRESHOLD such as max_prob:0.9 or entropy:1.5, got {text!r}") from None
        try:
            return cls(kind, value)
        except BlockloopError as exc:  # the rule's own check, said of the flag that gave it
            raise BlockloopError(f"--exit {text}: {exc}") from None

    def fires(self, logits: Tensor, loops_done: Tensor) -> Tensor:
        """``(B,)`` bool: which rows may exit, given their exit logits and how many loops they ran."""
        if self.kind in ("none", "oracle"):
            return torch.zeros_like(loops_done, dtype=torch.bool)
        log_probs = logits.float().log_softmax(-1)
        if self.kind == "max_prob":
            confident = log_probs.max(-1).values.exp() >= self.threshold
        else:
            confident = -(log_probs.exp() * log_probs).sum(-1) <= self.threshold
        return confident & (loops_done >= self.min_loops)


@dataclass
class DepthwiseState:
    """Sequence-wise state (cache, next slot/position per row) plus each row's in-flight token: its hidden
    state, loop, and the slot and position it is written at."""

    hidden: Tensor
    loop: Tensor
    slot: Tensor
    position: Tensor
    exits: Tensor  # how many tokens exited after each loop (statistics, on device)
    predictions: Tensor  # (rows, loops): the in-flight token's greedy prediction after each loop (oracle exit)
    exit_log: Tensor  # (rows, max_len): the loop (1-based) each token left after, at its input token's cache slot


class RecursiveRunner(DecoderRunner):
    """Serves a :class:`~blockloop.models.recursive.RecursiveDecoder`: sequence-wise without ``exit_rule``
    (every token runs every loop before the next), depth-wise with one (CYCLE tying: one loop per decode
    step, rows at their own loops, leaving by the rule), or self-speculatively with ``speculation``.

    ``loop_read`` is how a depth-wise step reads each row's loop of the :class:`LoopedCache` in place:
    ``"blocks"`` (FlexAttention over the row's live blocks only; the CUDA default for models without
    sliding-window layers or a prefix) or ``"dense"`` (a mask over every loop; the default otherwise)."""

    model: RecursiveDecoder

    def __init__(
        self, model: RecursiveDecoder, exit_rule: ExitRule | None = None, speculation: Speculation | None = None,
        paging: Paging | None = None, loop_read: str | None = None,
    ) -> None:
        super().__init__(model, paging)
        self.resumable = exit_rule is None and speculation is None  # sequence-wise: a decoder's rows
        self.chunked_prefill = self.chunked_prefill and self.resumable
        if paging is not None and loop_read is not None:
            raise BlockloopError("loop_read picks how a static looped cache is read; a paged one reads as Paging.read says")
        self.config = model.config
        self.exit_rule = exit_rule
        self.speculator = None if speculation is None else Speculator(model, speculation)
        if speculation is not None:
            if exit_rule is not None:
                raise BlockloopError("choose early exit (exit_rule) or speculation, not both: they are two decode modes")
            self.token_per_step = False  # speculating rows emit their own tokens (see the engine)
            self.emits = speculation.k + 1
        if exit_rule is not None:
            if exit_rule.min_loops > model.config.loops:
                raise BlockloopError(f"min_loops={exit_rule.min_loops} is more loops than the model's "
                                     f"{model.config.loops}: no token could leave early; lower it")
            if model.config.tying != "cycle":
                raise BlockloopError(
                    f"depth-wise batching needs cycle tying (rows share layers per loop), not {model.config.tying!r}; "
                    "drop --exit to decode it at full depth, or convert with --strategy cycle")
            self.token_per_step = False  # rows emit a token only when they leave a loop (see the engine)
        plain = not any(model.local) and not model.config.prefix_len  # every layer reads a full-length, prefix-free cache
        if loop_read == "blocks" and not plain:
            raise BlockloopError("the 'blocks' loop read needs a model without sliding-window layers or a prefix; "
                                 "use loop_read='dense'")
        self.loop_read = loop_read if loop_read is not None or plain else "dense"

    def allocate(self, n_slots: int, max_len: int) -> None:
        if self.speculator is not None:
            self.speculator.allocate(n_slots, max_len)
        if self.exit_rule is None:
            return super().allocate(n_slots, max_len)
        c, m, weight = self.config, self.model, self.model.embed.weight
        check_context(max_len, c.context_length, "cache", "allocate fewer slots")
        # the shared layers whose every depth position is a ring (local at every loop): one ring per loop
        rolling = [j for j in range(c.n_layer) if all(loop * c.n_layer + j in m.rolling for loop in range(c.loops))]
        if self.paging is not None:
            pages = self._checked(self.paging.pages(n_slots, max_len, weight.device, loops=c.loops))
            cache = PagedLoopedCache(c.n_layer, c.loops, n_slots, c.n_kv_head, max_len, c.head_dim, dtype=weight.dtype,
                                     pages=pages, rolling=rolling, window=c.sliding_window or 0)
        else:
            cache = LoopedCache(c.n_layer, c.loops, n_slots, c.n_kv_head, max_len, c.head_dim, dtype=weight.dtype,
                                device=weight.device, rolling=rolling, window=c.sliding_window or 0, read=self.loop_read)
        zeros = torch.zeros(n_slots, dtype=torch.long, device=weight.device)
        self.state = DecodeState.of(cache, prefixes=True)
        self.depth = DepthwiseState(weight.new_zeros(n_slots, 1, c.d_model), zeros.clone(), zeros.clone(), zeros.clone(),
                                    torch.zeros(c.loops, dtype=torch.long, device=weight.device),
                                    zeros.new_zeros(n_slots, c.loops), zeros.new_zeros(n_slots, max_len))
        static_state(self.depth.exits, self.depth.predictions, self.depth.exit_log)  # a step counts and logs in place

    @property
    def _pages(self) -> KVPages | None:
        cache = self.state.cache
        return cache.loop_pages if isinstance(cache, PagedLoopedCache) else cache.pages

    def _table_rows(self, slot: int) -> list[int]:
        """Depth-wise over pages: one page-table row per loop of the slot's request."""
        if not isinstance(self.state.cache, PagedLoopedCache):
            return [slot]
        return [loop * self.state.cache.batch_size + slot for loop in range(self.config.loops)]

    def _allocate_cache(self, n_slots: int, max_len: int, pages: KVPages | None) -> DecoderCache:
        # a speculative round writes k + 1 slots and may keep only one: rings keep room for the k it takes back
        return self.model.allocate_cache(n_slots, max_len, pages=pages, rollback=max(self.emits - 1, 0))

    def prefill_rows(self, start: int, prompts: Tensor) -> Tensor:
        if self.speculator is not None:
            self.speculator.start(slice(start, start + len(prompts)))
        return super().prefill_rows(start, prompts)

    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        if self.speculator is not None:
            self.speculator.start(slice(0, len(idx)))
        return super().prefill_batch(idx, token_valid)

    def release(self, slot: int) -> None:
        super().release(slot)
        if self.speculator is not None:
            # an idle row stops speculating, so the draft length it last wanted no longer sets the batch's (a
            # prefix step may never step it again to learn so)
            self.sampling.speculate[slot] = 0
            self.speculator.state.k_now[slot] = 0

    def check_request(self, sampling: SamplingParams) -> None:
        if self.speculator is None:
            return super().check_request(sampling)
        self.speculator.check(sampling)

    def compiled_step(self, compile: Callable[[Callable], Callable]) -> Callable[[Tensor], Tensor | StepOutput]:
        """A speculative step compiles its round (one graph per draft length); the host picks the length."""
        if self.speculator is None:
            return super().compiled_step(compile)
        speculator, run = self.speculator, compile(self.speculator.round)
        return lambda tokens: speculator.step(self.state, tokens, self.sampling, run)

    def step_states(self) -> list[object]:
        """The sequence-wise state, and the depth-wise rows' or the speculator's (allocated for continuous batches)."""
        extra = (getattr(self, "depth", None), getattr(self.speculator, "state", None))
        return [self.state, *(state for state in extra if state is not None)]

    def decode_step(self, tokens: Tensor) -> Tensor | StepOutput:
        if self.speculator is not None:
            return self.speculator.step(self.state, tokens, self.sampling)
        if self.exit_rule is None:
            return super().decode_step(tokens)
        return self._depthwise_step(tokens)

    @torch.no_grad()
    def _depthwise_step(self, tokens: Tensor) -> StepOutput:
        """One loop for each of the first ``len(tokens)`` rows. ``tokens`` holds a new token for rows that
        emitted one (they start loop 0 at their next slot) and -1 for rows still inside a token. Returns those
        rows' exit logits and which of them are ready to emit. The rows past them keep their state: idle,
        they are fed a token (a fresh start) once a request is prefilled into them."""
        m, decode, state = self.model, self.state, self.depth
        n, new = len(tokens), tokens >= 0
        cache = decode.prefixes[n]
        slot = torch.where(new, decode.next_slot[:n].clamp_max(cache.max_len - 1), state.slot[:n])
        next_position = decode.next_position[:n].clamp_max(m.config.context_length - 1)  # finished rows step on
        position = torch.where(new, next_position, state.position[:n])
        decode.next_slot = over_rows(decode.next_slot[:n] + new, decode.next_slot)
        decode.next_position = over_rows(decode.next_position[:n] + new, decode.next_position)
        embedded = m.embed_input(tokens.clamp_min(0)[:, None], position[:, None])
        x = torch.where(new[:, None, None], embedded, state.hidden[:n])
        loop = torch.where(new, 0, state.loop[:n])
        step = StepContext(cache, slot[:, None], position[:, None])
        x = m.run_loop(x, loop, cache.lift(m.loop_inputs(x, step), loop, step.slots), step=step)
        logits = m.exit_logits(x)[:, -1]
        last = loop == self.config.loops - 1
        ready = last | self.exit_rule.fires(logits[:, : self.config.vocab_size], loop + 1)
        exit_loop = loop
        if self.exit_rule.kind == "oracle":
            exit_loop = self._oracle_exit(state, logits, loop)
        elif self.exit_rule.kind != "none":  # the K/V an exited token owes the loops it skipped
            cache.copy_exits(ready & ~last, loop, slot)
        state.exits.index_add_(0, exit_loop, ready.long())
        rows = torch.arange(n, device=slot.device)
        state.exit_log[rows, slot] = torch.where(ready, exit_loop + 1, state.exit_log[rows, slot])
        state.hidden, state.loop = over_rows(x, state.hidden), over_rows(loop + 1, state.loop)
        state.slot, state.position = over_rows(slot, state.slot), over_rows(position, state.position)
        return StepOutput(logits, ready)

    def _oracle_exit(self, state: DepthwiseState, logits: Tensor, loop: Tensor) -> Tensor:
        """Record each of the first ``len(loop)`` rows' greedy prediction after ``loop``; for rows that just ran
        the last loop, the earliest loop (0-based) whose prediction equals the last one's (the last always does)."""
        rows = torch.arange(len(loop), device=loop.device)
        state.predictions[rows, loop] = logits[:, : self.config.vocab_size].argmax(-1)
        predictions = state.predictions[: len(loop)]
        return (predictions == predictions[:, -1:]).long().argmax(1)

    def exit_trajectory(self, row: int, start: int, n_tokens: int) -> list[int]:
        """The loops (1-based) the ``n_tokens`` tokens decoded in ``row`` from cache slot ``start`` on left
        after, i.e. of the request's output tokens 2.. (the first comes from the sequence-wise prefill).
        Read it once the request has finished, before its row is prefilled again (a host sync)."""
        return self.depth.exit_log[row, start : start + n_tokens].tolist()

    def forget_exits(self) -> None:
        """Clear the exit counts :meth:`mean_exit_loop` reads, in place (a captured step keeps counting into
        them): what follows, e.g. a benchmark's timed part after its warm-up, is counted alone."""
        self.depth.exits.zero_()

    def mean_exit_loop(self) -> float:
        """Average loops per emitted token so far (a host sync: for reports, not inside the loop)."""
        counts = self.depth.exits.double()
        return float((counts * torch.arange(1, len(counts) + 1, device=counts.device)).sum() / counts.sum().clamp_min(1))
