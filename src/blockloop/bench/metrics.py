"""Serving metrics from per-request timestamps: TTFT, TPOT, ITL, E2E latency and throughput.

Pure functions of timestamps, so they are tested on synthetic ones. Definitions (as vLLM's and
SGLang's benchmarks use them): TTFT = first token - arrival; TPOT = (last token - first token) /
(tokens - 1), per request; ITL = every gap between consecutive tokens of a request, pooled; E2E = last
token - arrival; throughput = all output tokens / (last finish - first arrival).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from blockloop.errors import BlockloopError

PERCENTILES = {"mean": None, "median": 50, "p90": 90, "p99": 99}


@dataclass(frozen=True)
class Timing:
    """When a request arrived and when each of its output tokens reached the client."""

    arrival: float
    token_times: Sequence[float]


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean / median / p90 / p99 of ``values`` (NaN for none)."""
    if len(values) == 0:
        return {name: float("nan") for name in PERCENTILES}
    array = np.asarray(values, dtype=np.float64)
    return {name: float(array.mean() if q is None else np.percentile(array, q)) for name, q in PERCENTILES.items()}


def serving_metrics(timings: Sequence[Timing]) -> dict[str, object]:
    """Throughput and latency percentiles for finished requests (each with at least one token)."""
    if not timings:
        raise BlockloopError("no finished requests to measure; submit at least one request")
    if any(len(t.token_times) == 0 for t in timings):
        raise BlockloopError("every measured request needs at least one output token")
    ttft = [t.token_times[0] - t.arrival for t in timings]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1) for t in timings if len(t.token_times) > 1]
    itl = [b - a for t in timings for a, b in zip(t.token_times, t.token_times[1:])]
    e2e = [t.token_times[-1] - t.arrival for t in timings]
    tokens = sum(len(t.token_times) for t in timings)
    span = max(t.token_times[-1] for t in timings) - min(t.arrival for t in timings)
    return {
        "requests": len(timings),
        "output_tokens": tokens,
        "duration_s": span,
        "throughput_tok_s": tokens / span if span > 0 else float("inf"),
        "ttft_s": summarize(ttft),
        "tpot_s": summarize(tpot),
        "itl_s": summarize(itl),
        "e2e_s": summarize(e2e),
    }
