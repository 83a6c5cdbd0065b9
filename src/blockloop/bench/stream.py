"""A request-stream benchmark for continuous batching: prompts of varied lengths cut from a built-in
corpus arrive as a Poisson process (or all at once), each asks for a varied number of tokens, and the
engine serves them with ``n_slots`` rows. Reports throughput and TTFT/TPOT/ITL/E2E percentiles."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from blockloop.bench.metrics import Timing, serving_metrics
from blockloop.choices import KEY_BUCKETS
from blockloop.data.tasks.tokenizer import refuse_text
from blockloop.data.tokenizers import Tokenizer
from blockloop.errors import BlockloopError, check_context
from blockloop.nn.linear import packed_linears
from blockloop.serve.engine import Engine
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import Runner, runner_for
from blockloop.serve.runners.recursive import RecursiveRunner

PROMPT_TEXT = 1 << 20  # characters of the corpus a stream's prompts are cut from


def corpus_prompts(
    vocab_size: int, n: int, min_len: int, max_len: int, *, corpus: str = "shakespeare", seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> list[list[int]]:
    """``n`` token slices of ``corpus`` with lengths uniform in ``[min_len, max_len]``: the model's own
    ``tokenizer``'s tokens (a trained or imported checkpoint's), or bytes (ids mod vocab) for a preset."""
    if tokenizer is not None:
        refuse_text(tokenizer, f"a request stream is cut from a corpus ({corpus}): bench it without --stream")
    text = corpus_text(corpus)
    if tokenizer is not None:
        tokens = tokenizer.encode(text)
    else:
        tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) % vocab_size
    return cut_prompts(tokens, n, min_len, max_len, seed=seed)


def corpus_text(corpus: str) -> str:
    """The first :data:`PROMPT_TEXT` characters of ``corpus``, which a stream's prompts are cut from."""
    from blockloop.data.corpora import load_documents

    documents = load_documents(corpus)
    return "\n".join(d if isinstance(d, str) else d.decode("utf-8", "replace") for d in documents)[:PROMPT_TEXT]


def cut_prompts(tokens: Sequence[int] | np.ndarray, n: int, min_len: int, max_len: int, *, seed: int = 0) -> list[list[int]]:
    """``n`` slices of ``tokens`` at seeded places, with lengths uniform in ``[min_len, max_len]``: the same
    prompts for the same tokens and seed, in process or over HTTP."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) <= max_len:
        raise BlockloopError(f"the corpus has {len(tokens)} tokens, too few to cut prompts of up to {max_len}; "
                             "lower the prompt range")
    rng = np.random.default_rng(seed)
    prompts = []
    for length in rng.integers(min_len, max_len + 1, size=n):
        start = int(rng.integers(0, len(tokens) - length))
        prompts.append(tokens[start : start + length].tolist())
    return prompts


def schedule(n: int, rate: float, min_tokens: int, max_tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """When each of ``n`` requests arrives (seconds after the first; Poisson at ``rate``/s, or all at 0 for inf) and
    how many tokens it asks for (uniform in ``[min_tokens, max_tokens]``): the same for the same seed, in process
    or over HTTP."""
    if rate <= 0:
        raise BlockloopError(f"--rate must be > 0 requests/s (inf for a fixed queue), got {rate}")
    if not 1 <= min_tokens <= max_tokens:
        raise BlockloopError(f"need 1 <= min tokens <= max tokens, got {min_tokens} and {max_tokens}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n) if np.isfinite(rate) else np.zeros(n)
    return np.cumsum(gaps) - gaps[0], rng.integers(min_tokens, max_tokens + 1, size=n)


def longest_request(runner: Runner, prompts: list[list[int]], budgets: np.ndarray) -> int:
    """The slot length the stream's longest request takes: a shared prefix, its padded prompt and its budget."""
    return runner.reserved + max(runner.padded(len(p)) + int(b) for p, b in zip(prompts, budgets))


def check_stream_fits(name: str, runner: Runner, prompts: list[list[int]], min_tokens: int, max_tokens: int, *,
                      rate: float, seed: int) -> None:
    """Refuse, before anything runs, a stream whose longest request (the budgets :func:`run_stream` will draw)
    does not fit ``runner``'s model context."""
    _, budgets = schedule(len(prompts), rate, min_tokens, max_tokens, seed)
    check_context(longest_request(runner, prompts, budgets), runner.model.config.context_length,
                  f"{name}: the stream's longest request (prompt and new tokens)", "lower --prompt-range or --tokens-range")


def run_stream(
    served: nn.Module | Runner, prompts: list[list[int]], *, n_slots: int, min_tokens: int, max_tokens: int,
    rate: float = float("inf"), sync_every: int | None = None, seed: int = 0, compile: bool = False, key_buckets: int = KEY_BUCKETS,
    warmup: int = 1, busy_rows: bool = True,
) -> dict[str, Any]:
    """Serve ``prompts`` arriving at ``rate`` requests/s (inf: all at t=0); metrics of the whole stream,
    and each request's ``outputs`` (in submission order). ``served`` is a model or its runner (a recursive
    model's depth-wise runner also reports its exits, a speculative one its acceptance); ``key_buckets`` and
    ``busy_rows``: the engine's; ``warmup``: untimed rounds first (see :func:`warm_up`). The metrics include the load
    the stream offers (its tokens over its last arrival): a throughput near it measured the arrivals, not the server."""
    offsets, budgets = schedule(len(prompts), rate, min_tokens, max_tokens, seed)
    runner = served if isinstance(served, Runner) else runner_for(served)
    # Slots as long as the stream's longest request, not the model's whole context.
    max_len = min(longest_request(runner, prompts, budgets), runner.model.config.context_length)
    engine = Engine(runner, n_slots, max_len=max_len, sync_every=sync_every, compile=compile, key_buckets=key_buckets,
                    busy_rows=busy_rows)
    greedy = SamplingParams(temperature=0.0)
    if compile:  # before the clock starts: compiling a step inside the stream would be timed as serving
        engine.compile_steps(shortest=min(map(len, prompts)), sampling=greedy, progress=True)
    depthwise = isinstance(runner, RecursiveRunner) and runner.exit_rule is not None
    speculator = runner.speculator if isinstance(runner, RecursiveRunner) else None
    requests, pending = [], list(zip(offsets, prompts, budgets))
    trajectories: dict[int, list[int]] = {}  # exit loops per request (depth-wise serving), read as each finishes
    rounds: dict[int, list[tuple[int, int]]] = {}  # (emitted, drafted) per verification round (speculation)
    with torch.no_grad(), packed_linears(runner.model, engine.step_rows):
        warm_steps = warm_up(engine, prompts, warmup, min_tokens)
        start = time.perf_counter()
        while pending or not engine.idle:
            now = time.perf_counter() - start
            while pending and pending[0][0] <= now:
                offset, prompt, budget = pending.pop(0)
                request = engine.submit(prompt, int(budget), sampling=greedy)
                request.arrival_time = start + offset  # the scheduled arrival, so queueing counts in TTFT
                requests.append(request)
            if engine.idle:
                time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
                continue
            for request in engine.step():
                decoded = len(request.output) - 1 + (request.finish_reason == "eos")
                if depthwise:
                    trajectories[request.id] = runner.exit_trajectory(request.slot, len(request.prompt), decoded)
                if speculator is not None:
                    rounds[request.id] = speculator.rounds_of(request.slot, len(request.prompt), decoded)
    metrics = serving_metrics([Timing(r.arrival_time, r.token_times) for r in requests])
    metrics.update(n_slots=n_slots, rate=rate, steps=engine.steps - warm_steps, sync_every=engine.sync_every,
                   admit_every=engine.admit_every, warmup=warmup)
    # the most a server could deliver here: every budget over the span of the arrivals (inf: all at once)
    metrics["offered_tok_s"] = float(sum(budgets)) / offsets[-1] if len(offsets) and offsets[-1] > 0 else float("inf")
    if depthwise:
        metrics["mean_exit_loop"] = runner.mean_exit_loop()
        metrics["exit_trajectories"] = [trajectories[r.id] for r in requests]
    if speculator is not None:
        metrics.update(speculation_metrics([rounds[r.id] for r in requests],
                                           [len(r.output) - 1 + (r.finish_reason == "eos") for r in requests]))
    metrics["outputs"] = [r.output for r in requests]
    return metrics


def warm_up(engine: Engine, prompts: list[list[int]], rounds: int, max_tokens: int) -> int:
    """Serve ``rounds`` batches of the stream's first prompts (one per slot, ``max_tokens`` each) before the clock
    starts, so that the first model of a run is not timed cold (allocator, kernel and library start-up) against
    warm later ones; the decode steps this took, and a depth-wise runner's exit counts are then cleared. Called
    with the stream's packed weights held, so that the timed part does not pack them again."""
    first = engine.steps
    for _ in range(rounds):
        for prompt in prompts[: engine.n_slots]:
            engine.submit(prompt, max_tokens, sampling=SamplingParams(temperature=0.0))
        while not engine.idle:
            engine.step()
    if isinstance(engine.runner, RecursiveRunner) and engine.runner.exit_rule is not None:
        engine.runner.forget_exits()
    return engine.steps - first


def speculation_metrics(rounds: list[list[tuple[int, int]]], decoded: list[int]) -> dict[str, float]:
    """Per stream, from each request's ``(emitted, drafted)`` rounds and its ``decoded`` tokens (those after the
    prefill's): the share of drafts kept, delivered tokens per verification pass (a pass emits 1 .. k + 1;
    the last round of a request may run past its limit, its extra tokens are not counted) and the passes."""
    passes = sum(map(len, rounds))
    drafted = sum(d for request in rounds for _, d in request)
    kept = sum(e - 1 for request in rounds for e, _ in request)
    return {"acceptance_rate": kept / max(drafted, 1), "tokens_per_pass": sum(decoded) / max(passes, 1),
            "verification_passes": passes}


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Share of positions where two greedy decodings of the same requests emit the same token."""
    pairs = [(a, b) for out, ref in zip(outputs, reference) for a, b in zip(out, ref)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)
