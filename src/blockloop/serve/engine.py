"""The serving engine: continuous (sequence-wise) batching of requests over a fixed set of cache slots.

Every model family takes part through its serving runner (:class:`~blockloop.serve.runners.base.Runner`,
built by :func:`~blockloop.serve.runners.runner_for`): allocate static caches for ``n_slots`` rows,
prefill a request into a slot, and run one decode step over all rows (a finished request's slot is simply
prefilled again by the next one), under the admission rules the runner declares. The engine owns everything else, once for
all families: the request queue (WAITING -> RUNNING -> FINISHED), per-request sampling on device
(:class:`~blockloop.serve.sampling.SlotSampling`), stopping, and streaming.

The decode loop runs a window of ``sync_every`` steps with no host synchronisation: sampled tokens (and
the tokens a runner emits itself, ``StepOutput.emitted``: a speculative step's accepted drafts) go to
a device ring buffer and are copied to the host once per window, where requests that hit EOS or their
token limit finish and free their slot, and waiting requests are prefilled into the free slots while the
others keep their caches. Where the runner can (``chunked_prefill``), every request being prefilled takes
its next chunk of at most ``prefill_chunk`` tokens at the start of each window, requests in consecutive
slots together in one forward whatever their lengths (:meth:`Runner.prefill_chunk`), so a long prompt
holds the running rows up for one chunk per window, not for its whole length; a request starts decoding
in the window its last chunk is cached. Other runners prefill requests admitted together into consecutive
slots with prompts of one padded length in one forward (:meth:`Runner.prefill_rows`).

Before each window every decoding row reserves room for it (:meth:`Runner.reserve`; a paged cache adds
pages as a request grows). When the cache is full, the newest request is preempted: it gives its room back
and waits at the head of the queue, to be prefilled again with its output so far. Rows that finished inside
a window keep stepping until its end (their extra tokens are discarded): the price of not syncing every token.
A window steps a fixed number of rows, busy or not, so the decode step has static shapes (``torch.compile``,
CUDA graphs): every slot, or, where the runner can (``prefix_steps``), the first ``n`` slots, ``n`` the
smallest of a few sizes (:func:`~blockloop.serve.runners.base.row_buckets`) that covers every busy slot, so a
lightly loaded engine does not pay for its idle slots (requests take the lowest free slots). Likewise along the keys:
before each window the engine tells the runner the most tokens any running request can hold by its end
(:meth:`Runner.limit_keys`), rounded up to the smallest of a few lengths
(:func:`~blockloop.serve.runners.base.key_lengths`), and a step over every slot of a static cache reads only those
leading slots of each row, not the whole ``max_len`` a slot reserves. A prefix step (a lighter load) reads every slot:
a compiled step is one graph per row count plus one per key length, not one per pair (each graph is a compile of its
own: about half the first one's time, pythia-5m on CPU, ``benchmarks/results/compile_time_cpu.md``).

A runner that cannot prefill one slot at a time (``per_slot = False``: a double decoder given a shared
cached prefix) is served in static batches instead: waiting requests are admitted together, left-padded,
once the previous batch has finished.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from blockloop.choices import KEY_BUCKETS
from blockloop.device import zeros_that_fit
from blockloop.errors import BlockloopError
from blockloop.nn.linear import packed_linears
from blockloop.progress import bar
from blockloop.serve.batching import left_pad
from blockloop.serve.requests import Request, RequestStatus, SamplingParams, TokenCallback, whole_number
from blockloop.serve.runners import Runner, runner_for
from blockloop.serve.runners.base import StepOutput, keep_rebound_state, key_lengths, row_buckets
from blockloop.serve.sampling import SlotSampling
from blockloop.serve.scheduler import Scheduler


def default_sync_every(device: torch.device) -> int:
    """Decode steps per window when none is asked for. On an accelerator a host sync stalls the queue of kernels
    the host has run ahead with, so a window of 8 steps amortises it. On CPU the host *is* the device and reading
    the tokens costs nothing, while a longer window only delays them: the first token waits for a whole window,
    streamed text arrives in bursts of a window, and rows that finish early keep stepping to its end (SmolLM2 on
    2 cores, 1 against 8: median TTFT 0.27x at the same throughput; ``benchmarks/results/sync_window_cpu.md``)."""
    return 1 if device.type == "cpu" else 8


def within_recompile_limit(step: Callable[[Tensor], object], extra_graphs: int) -> Callable[[Tensor], object]:
    """``step`` (compiled) allowed ``extra_graphs`` more than dynamo's recompile limit: past the limit dynamo runs a
    frame eagerly, and an engine cutting its keys compiles one more graph per key length besides its row counts
    (which :func:`row_buckets` keeps within the limit by themselves)."""
    if extra_graphs < 1:
        return step

    config = torch._dynamo.config

    def run(tokens: Tensor) -> object:  # set and reset by hand: config.patch costs ~140 us a step, this ~5
        limit = config.recompile_limit
        config.recompile_limit = limit + extra_graphs
        try:
            return step(tokens)
        finally:
            config.recompile_limit = limit

    return run


class Engine:
    """Batching over ``n_slots`` rows for one model (see the module docstring).

    ``served`` is a runner, or a model served by its family's default runner (:func:`runner_for`).
    ``compile=True`` wraps the decode step in ``torch.compile`` (``mode="reduce-overhead"``, i.e. CUDA
    graphs, on CUDA). ``prefill_chunk``: the most prompt tokens a request caches per window (runners with
    ``chunked_prefill``). ``sync_every``: decode steps per window (:func:`default_sync_every` when None).
    ``key_buckets``: how many key lengths a step over every slot may be cut to (:func:`key_lengths`; 0 or 1: every
    step reads all ``max_len`` slots); each is one more compiled graph. ``busy_rows``: a step over the first rows only,
    as many as are busy (rounded up to a power of two; runners with ``prefix_steps``), one compiled graph per row
    count; False: every step over every slot, one graph (for a saturated benchmark that cannot afford the compiles).
    The model is used as given: cast it
    (e.g. ``model.to(torch.bfloat16)``) first. It is put in eval mode (no dropout) and left so: an engine lives
    across many calls, so, unlike :func:`~blockloop.serve.generate.generate`, it has no moment to restore the
    mode; call ``model.train()`` to go on training after sampling with it.
    """

    def __init__(
        self,
        served: Runner | nn.Module,
        n_slots: int,
        *,
        max_len: int | None = None,
        sync_every: int | None = None,
        compile: bool = False,
        prefill_chunk: int = 512,
        key_buckets: int = KEY_BUCKETS,
        busy_rows: bool = True,
    ) -> None:
        runner = served if isinstance(served, Runner) else runner_for(served)
        model = runner.model
        self.continuous = runner.per_slot
        if not (whole_number(n_slots) and n_slots >= 1):
            raise BlockloopError(f"the engine needs a whole number of slots, at least one; got n_slots={n_slots!r}")
        weight = next(model.parameters())
        self.device = weight.device
        if sync_every is None:
            sync_every = default_sync_every(self.device)
        for name, value in (("sync_every", sync_every), ("prefill_chunk", prefill_chunk)):
            if not (whole_number(value) and value >= 1):
                raise BlockloopError(f"{name} must be a whole number, at least 1; got {value!r}")
        if not (whole_number(key_buckets) and key_buckets >= 0):
            raise BlockloopError(f"key_buckets must be a whole number, at least 0 (0: read every slot); got {key_buckets!r}")
        self.prefill_chunk = prefill_chunk
        self.prefilling: dict[int, int] = {}  # slot -> prompt tokens cached so far (chunked prefill)
        # Handing out a window's tokens, a cancel from a token callback frees its slot at the end (slot -> request).
        self._collecting, self._cancelled = False, {}
        self.admitted: list[int] = []  # running slots, oldest request first (the newest is preempted first)
        context = model.config.context_length
        self.max_len = context if max_len is None else max_len
        if not (whole_number(self.max_len) and self.max_len >= 1):
            raise BlockloopError(f"max_len (--max-len) must be a whole number, at least 1; got {self.max_len!r}")
        if self.max_len > context and not runner.streams:  # too short for a request is named below
            raise BlockloopError(f"max_len (--max-len) {self.max_len} is more than the model context of {context} "
                                 f"tokens; give at most {context}")
        model.eval()
        self.runner, self.model, self.n_slots = runner, model, n_slots
        self.reserved = runner.reserved  # context taken by a shared prefix
        # Windows end on admission points, so each window starts where new requests may join.
        self.admit_every = runner.admit_every
        self.token_per_step = runner.token_per_step
        self.sync_every = -(-sync_every // self.admit_every) * self.admit_every
        self.vocab_size = model.config.vocab_size
        if self.continuous:
            runner.allocate(n_slots, self.max_len)
        if self.room(1) < 1:  # every request would be refused: say so as the engine starts, not at each request
            if self._context_room(1) >= 1:
                raise BlockloopError("the paged KV cache holds less than a one-token prompt and its answer; give it more "
                                     "tokens (--kv-tokens)")
            fix = ("raise max_len (--max-len)" if runner.streams else
                   f"raise max_len (--max-len; at most the model context of {context})" if self.max_len < context
                   else "use a model with a longer context")
            raise BlockloopError(f"a context of {self.max_len} tokens leaves no room for a prompt and an answer; {fix}")
        self.rows = n_slots if self.continuous else 0  # rows the current decode state has
        self.row_counts = row_buckets(n_slots) if self.continuous and runner.prefix_steps and busy_rows else [self.rows]
        self.key_lengths = key_lengths(self.max_len, key_buckets if self.continuous else 0)
        self.scheduler = Scheduler(n_slots)
        self.logits = zeros_that_fit((n_slots, model.config.padded_vocab_size), weight.dtype, self.device,
                                     "serve fewer slots (--slots)")
        # Per step and row: the token the engine sampled, then those the runner emitted itself (-1: none).
        self.ring = torch.full((self.sync_every, n_slots, 1 + runner.emits), -1, dtype=torch.long, device=self.device)
        # Which rows' logits are a finished token's (always all, except under depth-wise batching).
        self.ready = torch.ones(n_slots, dtype=torch.bool, device=self.device)
        # Each slot's sampling parameters and how many tokens its request has sampled, on device.
        self.sampling = runner.sampling = SlotSampling.empty(n_slots, self.device)
        self._decode = runner.decode_step
        if compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            # static shapes: one graph per row count of a prefix step, one per key length of a full one; not dynamic
            compiled = keep_rebound_state(runner, runner.compiled_step(lambda step: torch.compile(step, mode=mode, dynamic=False)))
            self._decode = within_recompile_limit(compiled, len(self.key_lengths) - 1)
        self.steps = 0
        self.last_window: list[tuple[Request, list[int]]] = []

    # ------------------------------------------------------------- requests
    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        eos_id: int | None = None,
        on_token: TokenCallback | None = None,
    ) -> Request:
        """Queue a request; it is prefilled into the first free slot. Raises on a request that cannot fit."""
        try:
            prompt = [operator.index(t) for t in prompt]
        except TypeError:
            raise BlockloopError("a prompt is a sequence of integer token ids; encode text with the model's tokenizer "
                                 "first") from None
        if not prompt:
            raise BlockloopError("every prompt needs at least one token; give a non-empty prompt")
        if not (whole_number(max_tokens) and max_tokens >= 1):
            raise BlockloopError(f"max_tokens must be a whole number, at least 1; got {max_tokens!r}")
        if max(prompt) >= self.vocab_size or min(prompt) < 0:
            raise BlockloopError(f"prompt token ids must lie in [0, {self.vocab_size}); re-encode it with the model's tokenizer")
        if eos_id is not None and not (whole_number(eos_id) and 0 <= eos_id < self.vocab_size):
            raise BlockloopError(f"eos_id {eos_id!r} is not a token of the model's vocabulary [0, {self.vocab_size}), so "
                                 "no request would stop at it; pass the tokenizer's eos_id")
        if max_tokens > self._context_room(len(prompt)):
            raise BlockloopError(
                f"prompt of {self.runner.padded(len(prompt))} tokens plus {max_tokens} new tokens exceeds the engine's "
                f"{self.max_len - self.reserved}-token slots ({self._slot_size()}); shorten the prompt or lower max_tokens"
            )
        if self.continuous and not self.runner.can_hold([self.runner.padded(len(prompt)) + max_tokens], alone=True):
            raise BlockloopError(
                f"prompt of {self.runner.padded(len(prompt))} tokens plus {max_tokens} new tokens is more than the whole "
                "paged KV cache holds; give the engine more kv tokens, shorten the prompt or lower max_tokens")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise BlockloopError(f"sampling is a SamplingParams, got {type(sampling).__name__}; e.g. "
                                 "SamplingParams(temperature=0.0)")
        self.runner.check_request(sampling)
        request = Request(prompt, max_tokens, sampling, eos_id, on_token, arrival_time=time.perf_counter())
        self.scheduler.add(request)
        return request

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of ``prompt_len`` tokens may ask for (< 1: the prompt alone does not fit):
        what its slot leaves of the model context, and what a paged KV cache smaller than that holds."""
        padded, most = self.runner.padded(prompt_len), self._context_room(prompt_len)
        if most < 1 or not self.continuous:
            return most
        low, high = 0, most  # the most new tokens the empty pool holds, 0 if none (more never gets easier)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.runner.can_hold([padded + mid], alone=True) else (low, mid - 1)
        return low

    @property
    def longest_request(self) -> int:
        """The most tokens, prompt and answer together, one request can take: its slot's share of the context, and
        no more than the empty paged KV cache holds (``max_model_len`` to a client, which checks requests by it)."""
        prompt = self.runner.padded(1)
        return prompt + self.room(prompt)

    def cancel(self, request: Request) -> None:
        """Finish ``request`` now with reason ``"abort"`` (its client went away): a waiting request leaves the
        queue, a running one frees its slot for the next window's admissions. Call it between steps or from a token
        callback (it then takes no more of the window's tokens), from the thread that steps; a finished request is
        left as it is."""
        if request.finished:
            return
        if request.status is RequestStatus.WAITING:
            self.scheduler.waiting.remove(request)
        elif self._collecting:  # its slot is freed once the window's tokens are handed out
            self._cancelled[request.slot] = request
        else:
            self._release(request.slot)
        request.finish("abort", time.perf_counter())

    def _slot_size(self) -> str:
        """What bounds a slot, for an error: the model context, or the max_len a streaming runner was given."""
        if self.runner.streams:
            return "max_len; this model streams past its context: max_len (--max-len) may be raised"
        return "the model context"

    def _context_room(self, prompt_len: int) -> int:
        return self.max_len - self.reserved - self.runner.padded(prompt_len)

    # ------------------------------------------------------------- stepping
    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    @property
    def step_rows(self) -> int:
        """The most rows a decode step multiplies by each weight: a row per slot, or a speculative round's
        draft and bonus tokens per slot (what :func:`~blockloop.nn.linear.packed_linears` packs for)."""
        return self.n_slots * max(1, self.runner.emits)

    @torch.no_grad()
    def step(self, max_steps: int | None = None) -> list[Request]:
        """Admit waiting requests, decode one window, and hand its tokens to their requests.

        ``max_steps`` shortens the window (rounded up to a multiple of ``admit_every``; benchmarks use it
        to time the first token alone). Returns the requests that finished in this window.
        """
        if self.continuous:
            self._grow()
            admitted = self.scheduler.admit(fits=self._cache_holds)
            for slot, request in admitted:
                self.runner.reserve(slot, self._horizon(request))
                self.admitted.append(slot)
            if self.scheduler.running:  # before the prefills: on a GPU they read the limited keys too
                self.runner.limit_keys(self._key_length())
            if self.runner.chunked_prefill:
                self.prefilling.update((slot, 0) for slot, _ in admitted)
                for slot, _ in admitted:  # fed no token (-1) until its prompt is cached: its steps write nothing real
                    self.ready[slot] = False
                self._prefill_chunks()
            else:
                for start, group in self._prefill_groups(admitted):
                    self._prefill_rows(start, group)
        elif not self.scheduler.running:
            admitted = self.scheduler.admit(fits=self._fits_together)
            if admitted:  # an idle static engine has nothing to prefill
                self._prefill_batch(admitted)
        running = {slot: r for slot, r in self.scheduler.running.items() if slot not in self.prefilling}
        if not running:
            self.last_window = []  # a window of prefill only: no token came out
            return []
        steps, last = self.sync_every, False
        if max_steps is not None:
            steps = min(steps, -(-max_steps // self.admit_every) * self.admit_every)
        if not self.continuous or (self.admit_every == 1 and self.token_per_step):
            # Stop exactly when the longest request is done, skipping the decode after its last token
            # (a Block Transformer's continuous batch keeps whole blocks: its rows share the phase; a
            # depth-wise batch emits tokens at uneven steps).
            remaining = max(r.max_tokens - len(r.output) for r in running.values())
            steps, last = min(steps, remaining), remaining <= steps
        self.sampling.filtered = any(r.sampling.filters for r in running.values())
        self.sampling.greedy = all(r.sampling.temperature == 0 for r in running.values())  # idle rows: any token
        rows = self._stepped_rows()
        logits, ready = self.logits[:rows], self.ready[:rows]
        for i in range(steps):
            tokens = self.sampling.sample(logits[:, : self.vocab_size])
            tokens = torch.where(ready, tokens, -1)  # rows inside a token (depth-wise) or speculating emit nothing
            self.ring[i, :rows, 0] = tokens
            self.sampling.counter[:rows] += ready
            if not (last and i == steps - 1):
                # No reference to the last step's outputs lives through the next step (they are consumed above), so
                # under CUDA graphs cudagraph trees replay the graph they captured first rather than capturing one
                # more for every step of a window (a device sync and an allocator checkpoint each, in a timed run
                # for every key length it first reaches, and a copy of the outputs kept for each).
                out = logits = None
                if not self.token_per_step:
                    ready = None
                out = self._decode(tokens)
                if isinstance(out, StepOutput):
                    logits, ready = out.logits, out.ready
                    if out.emitted is not None:
                        self.ring[i, :rows, 1:] = out.emitted
                else:
                    logits = out
        self.ready[:rows] = ready
        # Kept in the engine's own buffer: a compiled step may reuse its output, and prefill writes rows here.
        self.logits[:rows] = logits
        self.steps += steps
        return self._collect(running, steps)

    def _stepped_rows(self) -> int:
        """How many rows (the first ones) this window steps: all the decode state has, or the fewest of the
        prefix step's row counts that hold every running request (prefilling ones too)."""
        if len(self.row_counts) == 1:
            return self.rows
        busy = max(self.scheduler.running) + 1
        return next(n for n in self.row_counts if n >= busy)

    def _key_length(self) -> int:
        """The shortest of :attr:`key_lengths` that holds every running request's tokens to the end of this window:
        what it has cached (its padded prompt and output; a preempted request is prefilled again with its output,
        which only runners that pad nothing do, :attr:`Runner.resumable`) plus what a window of steps adds (a
        speculative step writes its drafts and bonus token too); of :meth:`_lengths_for` this window's rows."""
        per_step = max(1, self.runner.emits)
        most = max(self.reserved + self.runner.padded(len(r.prompt)) + len(r.output) + self.sync_every * per_step
                   for r in self.scheduler.running.values())
        return next((n for n in self._lengths_for(self._stepped_rows()) if n >= most), self.max_len)

    def _lengths_for(self, rows: int) -> list[int]:
        """The key lengths a step over the first ``rows`` rows may read: every one of :attr:`key_lengths` for a step
        over every slot, ``max_len`` alone for a prefix step (see the module docstring): the keys are cut where the
        most rows read them."""
        return self.key_lengths if rows == self.n_slots else [self.max_len]

    def _prefill_groups(self, admitted: list[tuple[int, Request]]) -> list[tuple[int, list[Request]]]:
        """Requests admitted together in consecutive slots with prompts of one padded length, as
        ``(first slot, requests)``: each group is prefilled in one forward where the runner can."""
        groups: list[tuple[int, list[Request]]] = []
        for slot, request in admitted:
            if groups and groups[-1][0] + len(groups[-1][1]) == slot and (
                    self.runner.padded(len(self._context(groups[-1][1][0])))
                    == self.runner.padded(len(self._context(request)))):
                groups[-1][1].append(request)
            else:
                groups.append((slot, [request]))
        return groups

    # ------------------------------------------------------------- cache room
    def _horizon(self, request: Request) -> int:
        """The tokens ``request``'s row must hold to get through the next window: what it has cached plus a
        window of steps, at most its whole budget (the whole budget from the start where the runner cannot
        rebuild a preempted request's state, :attr:`Runner.resumable`)."""
        budget = self.runner.padded(len(request.prompt)) + request.max_tokens
        if not self.runner.resumable:
            return budget
        return min(budget, self.runner.padded(len(request.prompt)) + len(request.output) + self.sync_every)

    def _cache_holds(self, group: list[Request]) -> bool:
        """Whether the runner's cache has room for the first windows of ``group``, admitted together (a paged
        cache: free pages)."""
        return self.runner.can_hold([self._horizon(r) for r in group])

    def _grow(self) -> None:
        """Give every decoding row room for the coming window, oldest request first. When the cache is full the
        newest running request is preempted: its cache is dropped and it waits at the head of the queue, to
        be prefilled again with its output so far (the tokens it already streamed stay delivered)."""
        for slot in list(self.admitted):
            if slot not in self.admitted or slot in self.prefilling:
                continue
            while not self.runner.reserve(slot, self._horizon(self.scheduler.running[slot])):
                victim = self.admitted[-1]
                self._preempt(victim)
                if victim == slot:
                    break

    def _preempt(self, slot: int) -> None:
        request = self.scheduler.running[slot]
        self._release(slot)
        request.status, request.slot = RequestStatus.WAITING, None
        request.preemptions += 1
        self.scheduler.waiting.appendleft(request)

    def _release(self, slot: int) -> None:
        self.prefilling.pop(slot, None)
        self.admitted.remove(slot)
        self.scheduler.release(slot)
        self.runner.release(slot)

    @staticmethod
    def _context(request: Request) -> list[int]:
        """What a request's row caches when prefilled: its prompt, and the output of a preempted request."""
        return request.prompt + request.output

    def _prefill_chunks(self) -> None:
        """The next chunk of every request being prefilled, one forward per run of consecutive slots; the
        requests whose prompts are now cached join the decode."""
        runs: list[list[int]] = []
        for slot in sorted(self.prefilling):
            if runs and runs[-1][-1] + 1 == slot:
                runs[-1].append(slot)
            else:
                runs.append([slot])
        for slots in runs:
            prompts = [self._context(self.scheduler.running[slot]) for slot in slots]
            done = [self.prefilling[slot] for slot in slots]
            pieces = [p[d : d + self.prefill_chunk] for p, d in zip(prompts, done)]
            width = max(map(len, pieces))
            chunks, _ = left_pad(pieces, width, self.device, self.runner.pad_id)
            lengths = torch.tensor([len(p) for p in pieces], device=self.device)
            logits = self.runner.prefill_chunk(slots[0], chunks, lengths, torch.tensor(done, device=self.device))
            for i, (slot, prompt) in enumerate(zip(slots, prompts)):
                self.prefilling[slot] += len(pieces[i])
                if self.prefilling[slot] == len(prompt):
                    del self.prefilling[slot]
                    self.logits[slot] = logits[i]
                    self.ready[slot] = True
                    request = self.scheduler.running[slot]
                    self.sampling.set(slot, request.sampling, sampled=len(request.output))

    def _prefill_rows(self, start: int, requests: list[Request]) -> None:
        contexts = [self._context(r) for r in requests]
        prompts, _ = left_pad(contexts, self.runner.padded(len(contexts[0])), self.device, self.runner.pad_id)
        stop = start + len(requests)
        self.logits[start:stop] = self.runner.prefill_rows(start, prompts)
        self.ready[start:stop] = True
        for slot, request in enumerate(requests, start):
            self.sampling.set(slot, request.sampling, sampled=len(request.output))

    def _fits_together(self, group: list[Request]) -> bool:
        """Whether ``group`` fits the context as one static batch: all rows share one length."""
        longest = self.runner.padded(max(len(r.prompt) for r in group))
        return self.reserved + longest + max(r.max_tokens for r in group) <= self.max_len

    def _prefill_batch(self, admitted: list[tuple[int, Request]]) -> None:
        prompts = [r.prompt for _, r in admitted]
        idx, token_valid = left_pad(prompts, self.runner.padded(max(map(len, prompts))), self.device, self.runner.pad_id)
        self.runner.allocate(len(admitted), idx.shape[1] + max(r.max_tokens for _, r in admitted))
        logits = self.runner.prefill_batch(idx, token_valid)
        self.rows = len(admitted)
        self.admitted = [slot for slot, _ in admitted]
        for row, (slot, request) in enumerate(admitted):
            assert slot == row, "a static batch takes the slots from 0 up"
            self.logits[slot] = logits[row]
            self.sampling.set(slot, request.sampling)

    def _collect(self, running: dict[int, Request], steps: int) -> list[Request]:
        # A NaN or infinity in a row's logits is in its cache from then on, so the window's last logits show it:
        # whether they are finite rides along as each row's last column of the window's one host sync.
        finite = torch.isfinite(self.logits[:, : self.vocab_size]).all(-1, keepdim=True)
        window = torch.cat([self.ring[:steps].transpose(0, 1).flatten(1), finite.long()], 1).tolist()
        tokens, finite = [row[:-1] for row in window], [bool(row[-1]) for row in window]
        now = time.perf_counter()
        self.last_window, self._collecting, failure = [], True, None
        broken = [request for slot, request in running.items() if not finite[slot]]
        if broken:  # its tokens are argmaxes of NaN: garbage, not text
            failure = BlockloopError(
                f"the model's logits are not finite (NaN or infinite) for {len(broken)} of the {len(running)} running "
                f"requests, in {self.logits.dtype}: the weights overflow (a diverged run?) or the checkpoint is damaged; "
                "use an earlier checkpoint of the run")
            for request in broken:
                request.finish("abort", now)
        for slot, request in running.items():
            start = len(request.output)
            try:
                for token in tokens[slot]:
                    if request.finished or (token >= 0 and request.accept(token, now)):
                        break
            except BaseException as exc:  # its callback's error (or a Ctrl-C in it): raised once all is handed out
                failure = failure or exc
                if not request.finished:  # the rest of its window goes unseen: it ends here
                    request.finish("abort", now)
            self.last_window.append((request, request.output[start:]))
        self._collecting = False
        # Every other request took the window's tokens its cache already holds, whatever one callback raised: their
        # text stays what their model saw.
        ended = {slot: request for slot, request in running.items() if request.finished} | self._cancelled
        self._cancelled = {}
        for slot in ended:
            self._release(slot)
        if failure is not None:
            raise failure
        return list(ended.values())

    @torch.no_grad()
    def compile_steps(self, rows: Sequence[int] | None = None, shortest: int = 1, *, progress: bool = False,
                      sampling: SamplingParams | None = None) -> None:
        """Compile (and on CUDA capture: three calls each) the static decode steps this engine will run, before any
        request: compiled on first use instead, a step stalls the requests running then for its compile (tens of
        seconds a graph on a GPU). ``rows``: the row counts to compile (default every one of :attr:`row_counts`; a batch
        that keeps every slot busy runs only ``n_slots``); ``shortest``: no request holds fewer tokens (shorter
        key lengths are skipped). The steps run idle rows; afterwards the runner's decode state is put back as it
        was, in place (:meth:`_restored_state`), so the CUDA graphs captured over its tensors stay valid: allocated
        afresh instead, every graph would be captured again at its first use, inside whatever runs then.
        ``progress``: a bar over the graphs (a plain line every 30 s where no bar is drawn). ``sampling``: how the
        requests will sample, where every one samples alike (a benchmark's greedy stream): whether all rows are greedy
        and whether any filters are part of a speculative step's graph, so a step compiled for the other mode would be
        compiled again inside the run."""
        if not self.idle or not self.continuous:
            raise BlockloopError("compile an engine's steps before submitting requests, on a continuously batching one")
        if rows is not None and not set(rows) <= set(self.row_counts):
            raise BlockloopError(f"this engine steps {self.row_counts} rows at a time, not {sorted(set(rows))}")
        if sampling is not None:  # as the windows of such requests set them (_window)
            self.sampling.greedy, self.sampling.filtered = sampling.temperature == 0, sampling.filters
        tokens = torch.zeros(self.n_slots, dtype=torch.long, device=self.device)
        shapes = [(count, length) for count in (self.row_counts if rows is None else rows)
                  for length in [n for n in self._lengths_for(count) if n >= shortest] or [self.max_len]]
        with (packed_linears(self.model, self.step_rows), self._restored_state(),  # packed: the weights the steps see
              bar(total=len(shapes), desc="compiling decode steps", unit="graph", disable=not progress,
                  log_every=30) as graphs):
            for count, length in shapes:
                self.runner.limit_keys(length)
                for _ in range(3 * self.admit_every):  # a Block Transformer's step is a block's worth of steps
                    self._decode(tokens[:count])
                graphs.update()

    @contextmanager
    def _restored_state(self) -> Iterator[None]:
        """Put the runner's decode state back as it was on leaving: the fields a step rebinds, and the values of the
        tensors it updates in place (counters, logs, phases: what admission does not reset). The caches are not
        copied: admission clears a request's rows, and idle rows write into theirs at every step anyway."""
        holders = self.runner.step_states()
        fields = [dict(vars(holder)) for holder in holders]
        tensors = [t for f in fields for t in f.values() if isinstance(t, Tensor)]
        saved = [t.clone() for t in tensors]
        try:
            yield
        finally:
            for holder, f in zip(holders, fields):
                for name, value in f.items():
                    setattr(holder, name, value)
            for tensor, value in zip(tensors, saved):
                tensor.copy_(value)

    def run(self) -> None:
        """Step until every submitted request has finished, on CPU over oneDNN-packed weights
        (:func:`~blockloop.nn.linear.packed_linears`; a caller looping over :meth:`step` holds it itself)."""
        with packed_linears(self.model, self.step_rows):
            while not self.idle:
                self.step()

    def stream(self) -> Iterator[tuple[Request, list[int]]]:
        """Step until idle, yielding ``(request, new tokens)`` for each running request after every window
        (packed weights as in :meth:`run`, held until the stream ends or is closed)."""
        with packed_linears(self.model, self.step_rows):
            while not self.idle:
                self.step()
                yield from self.last_window
