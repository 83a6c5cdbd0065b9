"""Requests to the serving engine: what to generate, how to sample it, and what happened to it when."""

from __future__ import annotations

import enum
import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

from blockloop.errors import BlockloopError


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


INT64_MAX = 2**63 - 1  # the sampling tensors' type bounds top_k and seed


def wrap_seed(seed: int) -> int:
    """``seed`` wrapped into the int64 range a request's seed takes, so counting requests (``seed + i``: a chat's
    answers, ``generate``'s rows) past 2**63 - 1 goes on."""
    return (seed + 2**63) % 2**64 - 2**63


def whole_number(value: object) -> bool:
    """Whether ``value`` is an integer (a Python or NumPy int, a 0-d integer tensor), not a float or a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling: ``temperature`` 0 is greedy; ``seed`` fixes the request's random stream (default 0:
    reproducible, so requests that all leave it sample alike from the same prompt; give each its own, as
    ``generate`` and the server do when none is asked for).

    ``speculate`` is the request's draft length on a speculative runner (``None``: the runner's; 0: this
    request does not speculate); the tokens keep the distribution of plain sampling either way.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    speculate: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise BlockloopError(f"temperature must be a finite number >= 0, got {self.temperature!r}; use 0 for greedy "
                                 "decoding")
        if self.top_k is not None and not (whole_number(self.top_k) and 1 <= self.top_k <= INT64_MAX):
            raise BlockloopError(f"top_k must be an integer in [1, 2**63), got {self.top_k!r}; leave it unset to sample from all tokens")
        if not (whole_number(self.seed) and -INT64_MAX - 1 <= self.seed <= INT64_MAX):
            raise BlockloopError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise BlockloopError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.speculate is not None and not (whole_number(self.speculate) and self.speculate >= 0):
            raise BlockloopError(f"speculate must be a whole number >= 0 of draft tokens, got {self.speculate!r}; use 0 not to speculate")

    @property
    def filters(self) -> bool:
        return self.temperature > 0 and (self.top_k is not None or (self.top_p is not None and self.top_p < 1.0))


TokenCallback = Callable[["Request", int], None]
_ids = itertools.count()


@dataclass
class Request:
    """One prompt's life in the engine. Times are ``time.perf_counter()`` seconds on the host, taken when
    tokens reach the host: once per window of ``sync_every`` steps (every step on CPU by default; on a GPU, in
    small bursts)."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    eos_id: int | None = None
    on_token: TokenCallback | None = None
    id: int = field(default_factory=lambda: next(_ids))
    status: RequestStatus = RequestStatus.WAITING
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "length", or a callback's ("stop") or Engine.cancel's ("abort")
    slot: int | None = None
    arrival_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    preemptions: int = 0  # times the engine dropped its cache to make room and prefilled it again

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def accept(self, token: int, now: float) -> bool:
        """Take one sampled token; True once the request is complete (EOS, not kept, or max_tokens)."""
        if token == self.eos_id:
            self.finish("eos", now)
            return True
        self.output.append(token)
        self.token_times.append(now)
        if self.on_token is not None:
            self.on_token(self, token)
            if self.finished:  # the callback ended it (a stop string): the slot frees like at EOS
                return True
        if len(self.output) >= self.max_tokens:
            self.finish("length", now)
            return True
        return False

    def finish(self, reason: str, now: float) -> None:
        self.status, self.finish_reason, self.finish_time = RequestStatus.FINISHED, reason, now
