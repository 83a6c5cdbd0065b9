"""The one protocol the serving engine drives: a runner serves one model family.

Models only compute (their ``forward`` and the small compute methods of their paper); a runner owns
everything generation adds around them: the static caches and per-slot decode state, prefilling a
request into a slot, one decode step over every slot, and the admission rules the engine must respect.
Lock-step generation is the engine with every request admitted at once; a runner that cannot prefill
one slot at a time (``per_slot = False``) is given a static batch through :meth:`Runner.prefill_batch`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from blockloop.errors import BlockloopError
from blockloop.nn.kv_cache import DecoderCache
from blockloop.serve.requests import SamplingParams
from blockloop.serve.sampling import SlotSampling


class StepOutput(NamedTuple):
    """What :meth:`Runner.decode_step` returns when not every row takes one token from the engine per step.

    ``logits (n_slots, V)``: each row's next-token logits; the engine samples the ``ready`` rows from them
    and feeds the others -1 next step (a depth-wise row inside a token, a speculative row whose next token
    the runner holds). ``emitted (n_slots, emits)``: tokens the runner chose itself this step, in order,
    -1 padded (a speculative row's accepted drafts and corrected token); they follow the token the engine
    fed the row this step.
    """

    logits: Tensor
    ready: Tensor
    emitted: Tensor | None = None


class Runner(ABC):
    """Serves ``model`` over ``n_slots`` rows; every row is a slot holding one request.

    Admission rules, read by the engine:

    * ``prompt_multiple``: prompts are left-padded with ``pad_id`` to a multiple of this (a Block
      Transformer's block length);
    * ``admit_every``: requests join only every this many decode steps (a Block Transformer's rows
      share the within-block phase);
    * ``token_per_step``: False when :meth:`decode_step` returns a :class:`StepOutput`: only its ``ready``
      rows are sampled by the engine next step, the others are fed -1 (depth-wise batching, speculation);
    * ``emits``: how many tokens per row :meth:`decode_step` may choose itself (``StepOutput.emitted``;
      speculative decoding: its draft length plus one), 0 when the engine samples every token;
    * ``per_slot``: False when requests can only be served in static batches (:meth:`prefill_batch`);
    * ``resumable``: True when prefilling a request's prompt followed by its output so far rebuilds the
      state that decoding it built (a decoder's cache), so the engine may hold a row's cache room a window
      at a time and preempt a request when room runs out; otherwise a request reserves its whole budget
      (prompt + new tokens) when admitted;
    * ``chunked_prefill``: True when :meth:`prefill_chunk` can cache prompts of different lengths in one
      forward and continue a prompt from where an earlier chunk stopped (the engine then prefills every
      admitted request together, a bounded chunk per window);
    * ``reserved``: context every request gives up to something the runner holds (a shared cached prefix);
    * ``prefix_steps``: True when :meth:`decode_step` may be given the first ``n < n_slots`` rows only (``n``
      one of :func:`row_buckets`): the engine then steps the busy prefix of the slots, not every slot;
    * ``streams``: True when a row's keys and state have a fixed size and positions enter only relatively, whatever
      the length read (a staircase's windows; Transformer-XL's rings of its span, rotary): a request may run past
      the model context (``max_len`` above it; a decoder cache still books one byte per slot).
    """

    prompt_multiple: int = 1
    admit_every: int = 1
    token_per_step: bool = True
    per_slot: bool = True
    resumable: bool = False
    chunked_prefill: bool = False
    reserved: int = 0
    pad_id: int = 0
    emits: int = 0
    prefix_steps: bool = False
    streams: bool = False
    sampling: SlotSampling  # the engine's per-slot sampling state, set by the engine (read by runners that emit)

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def padded(self, prompt_len: int) -> int:
        """A prompt's length as the runner reads it: left-padded to a multiple of :attr:`prompt_multiple`."""
        return -(-prompt_len // self.prompt_multiple) * self.prompt_multiple

    def check_request(self, sampling: SamplingParams) -> None:
        """Refuse a request this runner cannot serve as asked (the engine calls it on submit)."""
        if sampling.speculate:
            raise BlockloopError(
                "this runner does not speculate; serve a looped model with runner_for(model, speculation=Speculation(k))"
            )

    @abstractmethod
    def allocate(self, n_slots: int, max_len: int) -> None:
        """Static caches and decode state for ``n_slots`` requests of up to ``max_len`` tokens each."""

    def can_hold(self, token_counts: list[int], *, alone: bool = False) -> bool:
        """Whether the cache has room now (with ``alone``: with nothing else held) for new requests of these
        lengths, prompt plus new tokens. A static cache always has: every slot holds ``max_len``."""
        return True

    def kv_cache_usage(self) -> float | None:
        """The share of a paged KV cache's pages held now (what bounds admissions, so what an operator watches);
        None for a static cache, where every slot holds ``max_len`` whatever it uses."""
        return None

    def reserve(self, slot: int, n_tokens: int) -> bool:
        """Hold room in row ``slot`` for the first ``n_tokens`` tokens of its request, adding to what it holds
        (a paged cache takes pages here; a static one holds ``max_len`` already); False when the cache has no
        room left, the engine then frees some by preempting a request."""
        return True

    def release(self, slot: int) -> None:
        """Row ``slot``'s request has finished: give back what :meth:`reserve` took."""

    def limit_keys(self, n_tokens: int) -> None:
        """Until told otherwise, no row that matters holds more than its first ``n_tokens`` tokens: a runner whose
        steps read a static cache reads only what they cover (:meth:`DecoderCache.visible
        <blockloop.nn.kv_cache.DecoderCache.visible>`); the others read what they read. The engine calls it before
        each window with one of :func:`key_lengths` (a static shape each)."""

    def prefill_slot(self, slot: int, prompt: Tensor) -> Tensor:
        """Take over row ``slot`` for ``prompt (P,)`` (the other rows keep their state); next-token logits ``(V,)``."""
        return self.prefill_rows(slot, prompt[None])[0]

    @abstractmethod
    def prefill_rows(self, start: int, prompts: Tensor) -> Tensor:
        """Take over rows ``start .. start + n - 1`` for ``n`` prompts of one length ``(n, P)`` admitted
        together, in one forward; next-token logits ``(n, V)``."""

    def prefill_chunk(self, start: int, chunks: Tensor, lengths: Tensor, offsets: Tensor) -> Tensor:
        """Cache the next piece of ``n`` prompts in rows ``start .. start + n - 1``: row ``i`` holds its prompt's
        first ``offsets[i]`` tokens already (0: a new request, whose row is cleared) and takes the
        ``lengths[i]`` real tokens at the end of ``chunks[i]`` (left-padded, ``(n, T)``). Next-token logits
        ``(n, V)`` after each row's last token (meaningful once its prompt is complete). Runners with
        ``chunked_prefill`` only."""
        raise NotImplementedError(f"{type(self).__name__} does not prefill in chunks")

    @abstractmethod
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Prefill rows ``0..B-1`` at once from left-padded prompts ``idx (B, P)`` (``token_valid`` marks the
        real tokens); next-token logits ``(B, V)``. The lock-step form of :meth:`prefill_rows`."""

    def compiled_step(self, compile: Callable[[Callable], Callable]) -> Callable[[Tensor], Tensor | StepOutput]:
        """The decode step with ``compile`` (e.g. ``torch.compile``) applied to its static graphs: the whole step
        here; a runner whose step follows a fixed host-side schedule between a few static steps (a Block
        Transformer: inside a block, or closing it) compiles each and keeps the choice on the host."""
        return compile(self.decode_step)

    def step_states(self) -> list[object]:
        """The dataclasses whose tensor fields a decode step rebinds (``state.x = ...``): what
        :func:`keep_rebound_state` copies out of a compiled step's memory."""
        return [self.state]

    @abstractmethod
    def decode_step(self, tokens: Tensor) -> Tensor | StepOutput:
        """Feed one token per row ``tokens (n_slots,)`` (-1: none); next-token logits ``(n_slots, V)`` (or,
        without ``token_per_step``, a :class:`StepOutput`). With ``prefix_steps``, ``tokens`` may cover the
        first ``n`` rows only (``n`` in :func:`row_buckets`): those rows step, the others keep their state."""


def row_buckets(n_slots: int) -> list[int]:
    """The row counts a prefix step runs at: the powers of two below ``n_slots``, and ``n_slots``. A handful of
    static shapes (one compiled graph, one CUDA graph each: the largest 8, within dynamo's recompile limit),
    while a lightly loaded engine steps at most twice the rows it has busy."""
    sizes = sorted({n_slots, *(1 << i for i in range(n_slots.bit_length()) if 1 << i < n_slots)})
    return sizes[-8:]


def key_lengths(max_len: int, count: int) -> list[int]:
    """The lengths a decode step's keys are cut to (:meth:`Runner.limit_keys`): ``max_len`` and up to ``count - 1``
    below it, each about 1/sqrt(2) of the next, rounded up to a multiple of 16 (whole tiles of the attention
    kernels). A step then reads at most about 1.4x the keys its longest row holds, in ``count`` static shapes
    (a compiled graph, a CUDA graph each). Ascending; ``count`` 0 or 1: ``[max_len]`` (every slot, always)."""
    lengths = {max_len}
    for i in range(1, count):
        length = -(-math.ceil(max_len / 2 ** (i / 2)) // 16) * 16
        if length < max_len:
            lengths.add(length)
    return sorted(lengths)


def static_state(*tensors: Tensor) -> None:
    """Mark decode-state tensors that a compiled step updates in place (a token log, a phase) as static
    addresses. Under CUDA graphs a step may mutate only inputs whose address never changes (module buffers such
    as the KV caches, and tensors marked so); mutating any other tensor makes inductor run the step eagerly
    every time. State a step replaces (``state.x = ...``) needs no mark: the new tensor is the graph's output,
    which :func:`keep_rebound_state` copies out before the next replay."""
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


def over_rows(prefix: Tensor, full: Tensor) -> Tensor:
    """``full`` with its first ``len(prefix)`` rows replaced by ``prefix``: per-row state a prefix step rebinds
    (a new tensor, the graph's output, not an in-place update; see :func:`static_state`)."""
    return prefix if len(prefix) == len(full) else torch.cat((prefix, full[len(prefix) :]))


def prefix_views(cache: DecoderCache) -> dict[int, DecoderCache]:
    """The cache of a step over the first ``n`` rows, for each row count ``n`` of :func:`row_buckets`: views of
    ``cache``'s rows, and ``cache`` itself at its full count. Built once, at allocation (a view is a module per
    layer: too slow to build every step)."""
    return {n: cache if n == cache.batch_size else cache.rows(0, n) for n in row_buckets(cache.batch_size)}


def keep_rebound_state(runner: Runner, step: Callable[[Tensor], Tensor | StepOutput]) -> Callable[[Tensor], Tensor | StepOutput]:
    """``step`` (a compiled decode step) with every state tensor it rebinds copied out after each call.

    A CUDA graph's outputs live in its memory pool until its next replay, which writes them again; a state tensor
    the next step reads must not be one of them (cudagraph trees refuse it as overwritten: seen on an H200,
    torch 2.11). The copies are a few per-row vectors per step; the KV caches, updated in place, are not copied."""
    def run(tokens: Tensor) -> Tensor | StepOutput:
        holders = runner.step_states()
        before = [{name: id(value) for name, value in vars(h).items() if isinstance(value, Tensor)} for h in holders]
        out = step(tokens)
        for holder, ids in zip(holders, before):
            for name, value in vars(holder).items():
                if isinstance(value, Tensor) and ids.get(name) != id(value):
                    setattr(holder, name, value.clone())
        return out

    return run
