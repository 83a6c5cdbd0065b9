"""The engine's own thread, and the bridge between it and the threads (or event loop) that take requests.

The engine is single-threaded: only its thread submits, steps and cancels. Other threads hand it
:class:`Job` s and cancellations through a queue, which it drains between windows (requests join at window
boundaries anyway), and get back one :class:`Event` per job and window through the job's ``deliver``
callback, called on the engine thread: an HTTP handler passes ``loop.call_soon_threadsafe`` into an asyncio
queue, the terminal chat a plain ``queue.Queue.put``. A token callback turns tokens into text
(:class:`~blockloop.serve.http.text.TextStream`) and ends its request at a stop string, so the slot frees at
the same window as on EOS. Requests waiting for a slot (those not yet running, less the slots free for them) are
bounded: past ``max_waiting``, :meth:`EngineWorker.submit` raises :class:`QueueFull` at once instead of queueing
without limit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from blockloop.choices import KEY_BUCKETS
from blockloop.errors import BlockloopError
from blockloop.nn.linear import packed_linears
from blockloop.serve.engine import Engine
from blockloop.serve.http.text import TextStream
from blockloop.serve.requests import Request, SamplingParams
from blockloop.serve.runners import ExitRule, Paging, Speculation, runner_for

log = logging.getLogger(__name__)
# The engine's finish reasons as the OpenAI API names them: EOS and stop strings are both "stop".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


def serving_engine(
    model: nn.Module, n_slots: int, *, max_len: int | None = None, sync_every: int | None = None,
    exit_rule: ExitRule | None = None, speculation: Speculation | None = None, compile: bool = False,
    prefill_chunk: int = 512, paging: Paging | None = None, key_buckets: int = KEY_BUCKETS,
) -> Engine:
    """The engine a server or chat runs: ``model``'s runner over ``n_slots`` slots; with ``exit_rule``, a looped
    model is batched depth-wise and leaves its loops early by that rule; with ``speculation``, it drafts with its
    first loops and verifies with all of them; with ``paging``, over a paged KV cache.
    ``compile``: every decode graph is compiled (and on CUDA captured) here, before the first request
    (:meth:`Engine.compile_steps`), rather than one at a time while requests wait for it."""
    runner = runner_for(model, paging=paging, exit_rule=exit_rule, speculation=speculation)  # refuses what it lacks
    engine = Engine(runner, n_slots, max_len=max_len, sync_every=sync_every, compile=compile,
                    prefill_chunk=prefill_chunk, key_buckets=key_buckets)
    if compile:
        engine.compile_steps(progress=True)
    return engine


class QueueFull(BlockloopError):
    """More requests are waiting for a slot than the server holds; the client should retry later."""


@dataclass
class Event:
    """What one window produced for a job: one text delta per new token, and at the end the finish reason
    (``stop``, ``length``, ``abort`` or ``error``), the held-back text (for ``error``, the message) and the
    token counts."""

    pieces: list[str]
    finish_reason: str | None = None
    tail: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Job:
    """One request as the caller gives it; ``deliver`` receives its events on the engine thread."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    text: TextStream
    deliver: Callable[[Event], None]
    eos_id: int | None = None
    arrival: float = field(default_factory=time.perf_counter)
    request: Request | None = None
    pieces: list[str] = field(default_factory=list)
    cancelled: bool = False

    def on_token(self, request: Request, token: int) -> None:
        self.pieces.append(self.text.push(token))
        if self.text.stopped:
            request.finish("stop", time.perf_counter())


class Observer(Protocol):
    """Told of every window's new tokens and every finished request, on the engine thread (the metrics)."""

    def on_window(self, new_tokens: int) -> None: ...

    def on_finish(self, request: Request) -> None: ...


class EngineWorker:
    """Runs ``engine`` on its own thread (``start``/``close``); ``submit`` and ``cancel`` from any thread.

    ``observer``, once one is set (:class:`~blockloop.serve.http.metrics.ServerMetrics` sets itself), is told of
    every window and finished request (:class:`Observer`).
    """

    def __init__(self, engine: Engine, *, max_waiting: int = 256) -> None:
        if max_waiting < 0:
            raise BlockloopError(f"--max-waiting must be at least 0, got {max_waiting}")
        self.engine, self.max_waiting = engine, max_waiting
        self.observer: Observer | None = None
        self.inbox: queue.Queue[tuple[str, Job | None]] = queue.Queue()
        self.lock = threading.Lock()
        # Submitted jobs not finished yet (guarded by ``lock``). Counting those admitted instead, as the engine
        # thread can only after its window, counted a request admitted in this window as waiting and as taking a
        # slot: a 503 while slots were free.
        self.in_flight = 0
        self.active: list[Job] = []  # jobs the engine holds (engine thread only)
        self.error: BaseException | None = None
        self.stopping: str | None = None  # why new jobs are refused and running ones were ended (see ``stop``)
        self.thread = threading.Thread(target=self._run, name="blockloop-engine", daemon=True)

    # ------------------------------------------------------------- any thread
    def start(self) -> None:
        self.thread.start()

    def stop(self, message: str) -> None:
        """End every job, running or queued, with ``message`` as its error, and refuse new ones (a server
        shutting down); the engine thread keeps running until ``close``."""
        with self.lock:
            self.stopping = message
        self.inbox.put(("stop", None))

    def close(self) -> None:
        """Stop the engine thread after its window; again, or before ``start``, nothing."""
        if self.thread.is_alive():
            self.inbox.put(("close", None))
            self.thread.join()

    @property
    def healthy(self) -> bool:
        return self.thread.is_alive() and self.error is None

    @property
    def running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def waiting(self) -> int:
        """Submitted requests not running yet (queued here or in the engine)."""
        return max(0, self.in_flight - self.running)

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` when ``max_waiting`` requests already wait for a slot. Under the lock
        the engine thread takes to fail everything, so no job slips into the inbox after it gave up."""
        with self.lock:
            if self.stopping is not None:
                raise BlockloopError(self.stopping)
            if not self.healthy:
                raise BlockloopError(f"the engine is not running ({self.error!r}); restart the server")
            # Jobs not running yet fill the free slots first; only those beyond them wait for a slot (waiting
            # less free slots = in flight less running less (slots less running) = in flight less slots).
            beyond = self.in_flight - self.engine.n_slots
            if beyond >= self.max_waiting:
                raise QueueFull(f"the queue is full: every slot is busy and {beyond} requests already wait for one "
                                f"(--max-waiting {self.max_waiting}); retry shortly")
            self.in_flight += 1
            self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Stop ``job`` (its client went away): its slot frees at the next window."""
        self.inbox.put(("cancel", job))

    # ------------------------------------------------------------- engine thread
    def _run(self) -> None:
        with packed_linears(self.engine.model, self.engine.step_rows):
            self._serve()

    def _serve(self) -> None:
        while True:
            if not self._drain(block=self.engine.idle):
                return
            if self.engine.idle:
                continue
            try:
                self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a bug or out of memory: fail the requests, stay up to say so
                log.exception("the engine failed; failing its requests")
                with self.lock:
                    self.error = exc
                    self._fail_all(f"the engine failed ({type(exc).__name__}: {exc}); restart the server")
                return
            if self.observer is not None:
                self.observer.on_window(sum(len(tokens) for _, tokens in self.engine.last_window))
            self._deliver()

    def _drain(self, block: bool) -> bool:
        """Take every queued command (waiting for one when ``block``); False once asked to close."""
        try:
            command, job = self.inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command == "close":
                return False
            if command == "stop":
                for held in self.active:
                    self.engine.cancel(held.request)
                with self.lock:
                    self._fail_all(self.stopping)
            elif command == "submit":
                self._submit(job)
            elif job.request is not None:
                self.engine.cancel(job.request)
            else:
                job.cancelled = True
            try:
                command, job = self.inbox.get_nowait()
            except queue.Empty:
                break
        self._deliver()  # cancellations finish at once
        return True

    def _submit(self, job: Job) -> None:
        if job.cancelled:
            self._done(1)
            return
        try:
            job.request = self.engine.submit(job.prompt, job.max_tokens, sampling=job.sampling, eos_id=job.eos_id,
                                             on_token=job.on_token)
        except BlockloopError as exc:  # callers check first (Engine.room); this is the engine's own word
            job.cancelled = True
            self._done(1)
            job.deliver(Event([], finish_reason="error", tail=str(exc)))
            return
        job.request.arrival_time = job.arrival  # time in this queue counts in the time to first token
        self.active.append(job)

    def _deliver(self) -> None:
        keep = []
        for job in self.active:
            request = job.request
            done = request.finished
            if job.pieces or done:
                event = Event(job.pieces, prompt_tokens=len(job.prompt), completion_tokens=len(request.output))
                job.pieces = []
                if done:
                    event.tail = job.text.flush() if request.finish_reason != "abort" else ""
                    # A stop string found only in the final decode (it holds a U+FFFD) ends the answer as a stop.
                    stopped = request.finish_reason != "abort" and job.text.stopped
                    event.finish_reason = "stop" if stopped else FINISH_REASONS[request.finish_reason]
                    if self.observer is not None:
                        self.observer.on_finish(request)
                job.deliver(event)
            if not done:
                keep.append(job)
        self._done(len(self.active) - len(keep))
        self.active = keep

    def _done(self, jobs: int) -> None:
        with self.lock:
            self.in_flight -= jobs

    def _fail_all(self, message: str) -> None:
        """Answer every job the engine holds and every job still in the inbox with ``message``."""
        queued = []
        while True:
            try:
                command, job = self.inbox.get_nowait()
            except queue.Empty:
                break
            if command == "submit":
                queued.append(job)
        for job in [*self.active, *queued]:
            job.deliver(Event([], finish_reason="error", tail=message))
        self.active = []
        self.in_flight = 0  # the caller holds the lock
