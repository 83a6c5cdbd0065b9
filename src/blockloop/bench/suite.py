"""A benchmark session: the models to compare, the throughput protocol over them, and the request stream.

What ``blockloop bench`` runs, as rows (one dict per model and batch size, or per model in the stream)
that a caller prints or appends to a JSON-lines record. The first model is the baseline the ratios
divide by. In the stream, looped models are also served depth-wise under each early-exit rule given, and
self-speculatively with each speculation given.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from blockloop.bench.hf_baseline import hf_throughput
from blockloop.bench.records import last_val_loss
from blockloop.bench.stream import agreement, check_stream_fits, corpus_prompts, run_stream
from blockloop.bench.throughput import engine_throughput, fresh_compile_caches, search_batches
from blockloop.bench.timing import copy_bandwidth
from blockloop.data.tokenizers import Tokenizer
from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name
from blockloop.serve.exit_schedule import simulate
from blockloop.serve.runners import RUNNERS, ExitRule, Runner, Speculation, runner_for
from blockloop.serve.runners.recursive import RecursiveRunner
from blockloop.train.run import load_trained

DEFAULT_PRESETS = "pythia-85m,block-85m"


@dataclass
class BenchModel:
    name: str
    model: nn.Module
    val_loss: float | None  # of a trained run, for the throughput-vs-loss plot
    tokenizer: Tokenizer | None = None  # a checkpoint's, so stream prompts are its real tokens


def bench_dtype(name: str, device: str) -> torch.dtype:
    """``float32`` / ``bfloat16``, or ``auto``: bfloat16 on CUDA, float32 on CPU."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        name, torch.bfloat16 if device.startswith("cuda") else torch.float32)


def load_models(
    presets: str | None, checkpoints: list[str], device: str, dtype: torch.dtype, seed: int = 0
) -> list[BenchModel]:
    """Comma-separated ``presets`` randomly initialised (seeded), then trained ``checkpoints``; with neither given,
    the Block Transformer paper's pair."""
    models = []
    names = presets if presets is not None else ("" if checkpoints else DEFAULT_PRESETS)
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        torch.manual_seed(seed)
        models.append(BenchModel(name, build_model(from_name(name)).to(device=device, dtype=dtype).eval(), None))
    for path in checkpoints:
        trained = load_trained(path, device)
        models.append(BenchModel(Path(path).name, trained.model.to(dtype), last_val_loss(Path(path)), trained.tokenizer))
    if not models:
        raise BlockloopError("nothing to bench: give --presets or --checkpoint")
    return models


def measure_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy: the roofline's memory bandwidth."""
    return copy_bandwidth(device, nbytes=(1 << 28) if device.type == "cuda" else (1 << 26))


@dataclass
class ThroughputSettings:
    """The throughput protocol (Block Transformer section 3.2) at each batch size."""

    prompt_len: int
    gen_len: int
    batches: list[int]
    repeats: int = 3
    warmup: int = 1
    sync_every: int = 16
    compile: bool = False
    search: bool = False  # keep doubling past the list until out of memory
    max_batch: int = 4096
    seed: int = 0
    hf: bool = False  # also time HF generate() on the first model
    caches: tuple[str, ...] = ("static",)  # "static" and/or "paged": the KV caches to time a model that pages over

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise BlockloopError("--repeats must be >= 1 and --warmup >= 0")


def throughput_rows(models: list[BenchModel], settings: ThroughputSettings, bandwidth: float,
                    on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One row per model and batch size, with ``ratio_vs_baseline`` to the first model at the same batch;
    ``on_row`` sees each row as it is measured (a device call stopped at its time limit keeps what it printed)."""
    s = settings
    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)
    for m in models:
        for paged in [kind == "paged" for kind in (s.caches if pages_kv(m.model) else ("static",))]:
            def one(batch: int, model: nn.Module = m.model, name: str = m.name + " paged" * paged, paged: bool = paged) -> Any:
                return engine_throughput(model, name, batch, s.prompt_len, s.gen_len, repeats=s.repeats, warmup=s.warmup,
                                         sync_every=s.sync_every, compile=s.compile, bandwidth=bandwidth, seed=s.seed,
                                         paged=paged)
            for result in search_batches(one, s.batches, search=s.search, max_batch=s.max_batch):
                add({"kind": "throughput", "val_loss": m.val_loss, **result.to_dict()})
    if s.hf:
        for batch in s.batches:
            add({"kind": "throughput", "val_loss": None, **hf_throughput(
                models[0].model, batch, s.prompt_len, s.gen_len, repeats=s.repeats, warmup=s.warmup, seed=s.seed).to_dict()})
    base = {r["batch"]: r["tok_s"] for r in rows if r["name"] == models[0].name}
    for r in rows:
        r["ratio_vs_baseline"] = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None
    return rows


def pages_kv(model: nn.Module) -> bool:
    """Whether ``model``'s runner can serve it over a paged KV cache."""
    return "paging" in inspect.signature(RUNNERS[model.config.family]).parameters


def parse_exit_rule(text: str) -> ExitRule:
    """``RULE:THRESHOLD`` (``max_prob:0.9``, ``entropy:2.0``, ``none:0``) or ``oracle``."""
    kind, _, threshold = text.partition(":")
    if kind in ("none", "oracle"):  # rules that read no threshold: one given would be ignored, so refuse it
        if threshold.strip() not in ("", "0", "0.0"):
            raise BlockloopError(f"--exit {kind} reads no threshold, got {text!r}; give {kind} (or {kind}:0)")
        return ExitRule(kind, 0.0)
    try:
        value = float(threshold)
    except ValueError:
        raise BlockloopError(f"--exit takes RULE:THRESHOLD such as max_prob:0.9 or entropy:1.5, got {text!r}") from None
    return ExitRule(kind, value)


def rule_name(rule: ExitRule) -> str:
    return "oracle" if rule.kind == "oracle" else f"{rule.kind}:{rule.threshold:g}"


def speculation_name(speculation: Speculation) -> str:
    k = f"adaptive k<={speculation.k}" if speculation.adaptive else f"k={speculation.k}"
    return f"speculative {k} draft {speculation.draft_loops} loop{'s' * (speculation.draft_loops > 1)}"


@dataclass
class StreamSettings:
    """A stream of corpus prompts served with continuous batching."""

    requests: int = 64
    slots: int = 16
    prompt_range: tuple[int, int] = (16, 64)
    tokens_range: tuple[int, int] = (16, 64)
    rate: float = float("inf")  # Poisson arrivals per second; inf = a fixed queue
    corpus: str = "shakespeare"
    sync_every: int = 16
    compile: bool = False
    seed: int = 0
    exits: list[ExitRule] = field(default_factory=list)  # depth-wise early-exit rules for looped models
    speculations: list[Speculation] = field(default_factory=list)  # self-speculative decoding of looped models

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise BlockloopError(f"--requests must be >= 1, got {self.requests}")


def stream_rows(models: list[BenchModel], settings: StreamSettings) -> Iterator[dict[str, Any]]:
    """One row per served model, yielded as each finishes: serving metrics, and for depth-wise runs the mean
    exit loop, the simulated schedules (RRT appendix N) and greedy agreement with the sequence-wise run.

    Every runner and prompt is made, and every request checked against its model's context, before this returns:
    a bad setting fails before the first model runs, not after it."""
    s = settings
    served: list[tuple[str, Runner, BenchModel, str | None, list[list[int]]]] = []
    for m in models:
        runners = [(m.name, runner_for(m.model), None)]
        if isinstance(runners[0][1], RecursiveRunner):
            runners += [(f"{m.name} depth-wise exit {rule_name(r)}", runner_for(m.model, exit_rule=r), m.name)
                        for r in s.exits]
            runners += [(f"{m.name} {speculation_name(sp)}", runner_for(m.model, speculation=sp), m.name)
                        for sp in s.speculations]
        prompts = corpus_prompts(m.model.config.vocab_size, s.requests, *s.prompt_range, corpus=s.corpus, seed=s.seed,
                                 tokenizer=m.tokenizer)
        for name, runner, reference in runners:
            check_stream_fits(name, runner, prompts, *s.tokens_range, rate=s.rate, seed=s.seed)
            served.append((name, runner, m, reference, prompts))
    return _serve_streams(served, s)


def _serve_streams(served: list[tuple[str, Runner, BenchModel, str | None, list[list[int]]]],
                   s: StreamSettings) -> Iterator[dict[str, Any]]:
    first: float | None = None
    outputs: dict[str, list[list[int]]] = {}
    throughput: dict[str, float] = {}
    for name, runner, bench_model, reference, prompts in served:
        if s.compile:  # each server compiles its own steps, within dynamo's recompile limit (see fresh_compile_caches)
            fresh_compile_caches()
        m = run_stream(runner, prompts, n_slots=s.slots, min_tokens=s.tokens_range[0], max_tokens=s.tokens_range[1],
                       rate=s.rate, sync_every=s.sync_every, seed=s.seed, compile=s.compile)
        outputs[name] = m.pop("outputs")
        throughput[name] = m["throughput_tok_s"]
        if "exit_trajectories" in m:
            m["simulated"] = simulate(m.pop("exit_trajectories"), s.slots, runner.model.config.loops)
            m["mean_exit_loop"] = m["simulated"]["mean_exit_loop"]  # of the delivered tokens only
        if reference is not None:  # the same model served sequence-wise, in this run
            m["agreement_vs_no_exit"] = agreement(outputs[name], outputs[reference])
            m["ratio_vs_same_model"] = m["throughput_tok_s"] / throughput[reference]
        m["ratio_vs_baseline"] = m["throughput_tok_s"] / first if first is not None else 1.0
        first = m["throughput_tok_s"] if first is None else first
        yield {"kind": "stream", "name": name, "val_loss": bench_model.val_loss, **m}
