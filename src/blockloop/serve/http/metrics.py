"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own.

Gauges are read from the worker when scraped (requests waiting and running, slots in use, and with a paged KV
cache the share of its pages held); counters and histograms are fed by the engine thread as windows end and
requests finish (tokens, time to first token, time per output token, end-to-end latency), with the engine's host
times, as ``blockloop bench`` measures them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from blockloop.serve.http.worker import FINISH_REASONS, EngineWorker
from blockloop.serve.requests import Request

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The metrics of ``worker``'s engine; becomes the worker's observer."""

    def __init__(self, worker: EngineWorker) -> None:
        self.registry = r = CollectorRegistry()
        n_slots = worker.engine.n_slots
        Gauge("blockloop_requests_waiting", "requests waiting for a slot", registry=r).set_function(lambda: worker.waiting)
        Gauge("blockloop_requests_running", "requests holding a slot", registry=r).set_function(lambda: worker.running)
        Gauge("blockloop_slots", "engine slots (requests decoded together)", registry=r).set(n_slots)
        Gauge("blockloop_slot_usage", "share of the slots in use", registry=r).set_function(
            lambda: worker.running / n_slots)
        runner = worker.engine.runner
        if runner.kv_cache_usage() is not None:  # a paged cache (--kv-tokens): as vLLM's kv_cache_usage_perc
            Gauge("blockloop_kv_cache_usage", "share of the paged KV cache's pages held", registry=r).set_function(
                runner.kv_cache_usage)
        self.prompt_tokens = Counter("blockloop_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("blockloop_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("blockloop_requests_finished", "finished requests by reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("blockloop_requests_rejected", "requests refused with 503 (queue full)", registry=r)
        self.ttft = Histogram("blockloop_time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("blockloop_time_per_output_token_seconds", "per request: (last - first token) / "
                              "(tokens - 1)", registry=r, buckets=TOKEN_BUCKETS)
        self.e2e = Histogram("blockloop_e2e_request_latency_seconds", "arrival to finish", registry=r,
                             buckets=LATENCY_BUCKETS)
        worker.observer = self

    def on_window(self, new_tokens: int) -> None:
        self.generation_tokens.inc(new_tokens)

    def on_finish(self, request: Request) -> None:
        self.prompt_tokens.inc(len(request.prompt))
        self.finished.labels(FINISH_REASONS[request.finish_reason]).inc()
        times, arrival = request.token_times, request.arrival_time
        if times:
            self.ttft.observe(times[0] - arrival)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        self.e2e.observe(request.finish_time - arrival)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
