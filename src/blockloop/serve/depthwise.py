"""Continuous depth-wise batching with confidence-based early exit for Recursive Transformers
(Bae et al. 2024, section 2.4 and appendix N).

Sequence-wise serving runs all ``B`` loops of a token before the next. Here one decode step runs ONE
loop of the shared block over every row, each row at its own loop (its per-loop LoRA gathered by loop
index, :meth:`RecursiveDecoder.run_loop` with a ``(rows,)`` loop tensor). After loop ``k`` a row's exit
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
have left after. Those exit trajectories (:meth:`DepthwiseRecursive.exit_trajectory`) are then scheduled
by :mod:`blockloop.serve.exit_schedule`, which counts the steps a depth-wise batch would need against a
sequence-wise one, the paper's simulated speedup.

The engine drives this wrapper like any model: ``decode_step`` returns ``(logits, ready)``, and the
engine samples only rows that are ``ready`` (token -1 for the others).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from blockloop.errors import BlockloopError
from blockloop.models.decoder import DecodeState
from blockloop.nn.kv_cache import DecoderCache

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

    decode: DecodeState
    hidden: Tensor
    loop: Tensor
    slot: Tensor
    position: Tensor
    exits: Tensor  # how many tokens exited after each loop (statistics, on device)
    predictions: Tensor  # (rows, loops): the in-flight token's greedy prediction after each loop (oracle exit)
    exit_log: Tensor  # (rows, max_len): the loop (1-based) each token left after, at its input token's cache slot


class DepthwiseRecursive(nn.Module):
    """Serves a :class:`~blockloop.models.recursive.RecursiveDecoder` (CYCLE tying) depth-wise."""

    def __init__(self, model: nn.Module, exit_rule: ExitRule | None = None) -> None:
        super().__init__()
        if getattr(model.config, "family", None) != "recursive":
            raise BlockloopError(f"depth-wise batching serves recursive models, not {model.config.family} models")
        if model.config.tying != "cycle":
            raise BlockloopError(f"depth-wise batching needs cycle tying (rows share layers per loop), not {model.config.tying!r}")
        self.model, self.config = model, model.config
        self.exit_rule = exit_rule or ExitRule("none")
        self.token_per_step = False  # rows emit a token only when they leave a loop (see the engine)

    def allocate_slots(self, n_slots: int, max_len: int) -> DepthwiseState:
        c, weight = self.config, self.model.embed.weight
        if max_len > c.context_length:
            raise ValueError(f"cache of {max_len} tokens exceeds the model context of {c.context_length}")
        cache = DecoderCache.looped(c.n_layer, c.loops, n_slots, c.n_kv_head, max_len, c.head_dim,
                                    dtype=weight.dtype, device=weight.device)
        zeros = torch.zeros(n_slots, dtype=torch.long, device=weight.device)
        return DepthwiseState(DecodeState(cache, zeros, zeros.clone()), weight.new_zeros(n_slots, 1, c.d_model),
                              zeros.clone(), zeros.clone(), zeros.clone(), torch.zeros(c.loops, dtype=torch.long, device=weight.device),
                              zeros.new_zeros(n_slots, c.loops), zeros.new_zeros(n_slots, max_len))

    @torch.no_grad()
    def prefill_slot(self, state: DepthwiseState, slot: int, prompt: Tensor) -> Tensor:
        """The prompt runs every loop (sequence-wise); its next-token logits are the last loop's."""
        return self.model.prefill_slot(state.decode, slot, prompt)

    @torch.no_grad()
    def decode_step(self, state: DepthwiseState, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """One loop for every row. ``tokens`` holds a new token for rows that emitted one (they start loop
        0 at their next slot) and -1 for rows still inside a token. Returns every row's exit logits and
        which rows are ready to emit."""
        m, decode = self.model, state.decode
        new = tokens >= 0
        max_len = decode.cache.max_len
        slot = torch.where(new, decode.next_slot.clamp_max(max_len - 1), state.slot)
        position = torch.where(new, decode.next_position, state.position)
        decode.next_slot = decode.next_slot + new
        decode.next_position = decode.next_position + new
        embedded = m.drop(m.embed_tokens(tokens.clamp_min(0)[:, None], position[:, None]))
        x = torch.where(new[:, None, None], embedded, state.hidden)
        loop = torch.where(new, 0, state.loop)
        inputs = m.body.layer_inputs(x, positions=position[:, None], cache=decode.cache, slots=slot[:, None])
        x = m.run_loop(x, loop, inputs, cache=decode.cache, slots=slot[:, None])
        logits = m.exit_logits(x)[:, -1]
        last = loop == self.config.loops - 1
        ready = last | self.exit_rule.fires(logits[:, : self.config.vocab_size], loop + 1)
        exit_loop = loop
        if self.exit_rule.kind == "oracle":
            exit_loop = self._oracle_exit(state, logits, loop)
        elif self.exit_rule.kind != "none":
            self._fill_owed(decode.cache, ready & ~last, loop, slot)
        state.exits.index_add_(0, exit_loop, ready.long())
        rows = torch.arange(len(slot), device=slot.device)
        state.exit_log[rows, slot] = torch.where(ready, exit_loop + 1, state.exit_log[rows, slot])
        state.hidden, state.loop, state.slot, state.position = x, loop + 1, slot, position
        return logits, ready

    def _oracle_exit(self, state: DepthwiseState, logits: Tensor, loop: Tensor) -> Tensor:
        """Record each row's greedy prediction after ``loop``; for rows that just ran the last loop, the
        earliest loop (0-based) whose prediction equals the last one's (the last always does)."""
        rows = torch.arange(len(loop), device=loop.device)
        state.predictions[rows, loop] = logits[:, : self.config.vocab_size].argmax(-1)
        matches = state.predictions == state.predictions[:, -1:]
        return matches.long().argmax(1)

    def exit_trajectory(self, state: DepthwiseState, row: int, start: int, n_tokens: int) -> list[int]:
        """The loops (1-based) the ``n_tokens`` tokens decoded in ``row`` from cache slot ``start`` on left
        after, i.e. of the request's output tokens 2.. (the first comes from the sequence-wise prefill).
        Read it once the request has finished, before its row is prefilled again (a host sync)."""
        return state.exit_log[row, start : start + n_tokens].tolist()

    def _fill_owed(self, cache: DecoderCache, exited: Tensor, loop: Tensor, slot: Tensor) -> None:
        """Copy the K/V an early-exited token wrote at its exit loop into every deeper loop's entry."""
        rows = torch.arange(loop.shape[0], device=loop.device)
        for k_stack, v_stack in cache.stacked:
            for buffer in (k_stack, v_stack):
                exit_kv = buffer[loop, rows, :, slot]
                for deeper in range(1, self.config.loops):
                    owed = (exited & (loop < deeper))[:, None, None]
                    buffer[deeper, rows, :, slot] = torch.where(owed, exit_kv, buffer[deeper, rows, :, slot])

    def mean_exit_loop(self, state: DepthwiseState) -> float:
        """Average loops per emitted token so far (a host sync: for reports, not inside the loop)."""
        counts = state.exits.double()
        return float((counts * torch.arange(1, len(counts) + 1, device=counts.device)).sum() / counts.sum().clamp_min(1))
