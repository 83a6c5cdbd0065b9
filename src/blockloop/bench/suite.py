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
from blockloop.choices import KEY_BUCKETS
from blockloop.data.tokenizers import Tokenizer
from blockloop.device import auto_dtype
from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name, spec_of
from blockloop.serve.exit_schedule import simulate
from blockloop.serve.runners import RUNNERS, ExitRule, Runner, Speculation, runner_for
from blockloop.serve.runners.recursive import RecursiveRunner
from blockloop.train.checkpoint import resolve_checkpoint, run_folder
from blockloop.train.run import load_trained

DEFAULT_PRESETS = "pythia-85m,block-85m"
CACHES = ("static", "whole-keys", "paged", "paged-kernel")


@dataclass
class BenchModel:
    name: str
    model: nn.Module
    val_loss: float | None  # of a trained run, for the throughput-vs-loss plot
    tokenizer: Tokenizer | None = None  # a checkpoint's, so stream prompts are its real tokens
    val_loss_measure: str | None = None  # what val_loss scores, and in which tokens: plotted together only if equal


def bench_dtype(name: str, device: str) -> torch.dtype:
    """One of :data:`~blockloop.choices.BENCH_DTYPES`: ``float32``, ``bfloat16``, or ``auto`` (:func:`auto_dtype`)."""
    return auto_dtype(device) if name == "auto" else getattr(torch, name)


def load_models(
    presets: str | None, checkpoints: list[str], device: str, dtype: torch.dtype, seed: int = 0
) -> list[BenchModel]:
    """Comma-separated ``presets`` randomly initialised (seeded), then trained ``checkpoints``; with neither given,
    the Block Transformer paper's pair."""
    models = []
    names = presets if presets is not None else ("" if checkpoints else DEFAULT_PRESETS)
    names = [n.strip() for n in names.split(",") if n.strip()]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise BlockloopError(f"--presets names {twice} more than once; name each model once")
    for name in names:
        torch.manual_seed(seed)
        models.append(BenchModel(name, build_model(from_name(name)).to(device=device, dtype=dtype).eval(), None))
    resolved = [resolve_checkpoint(Path(path)).resolve() for path in checkpoints]
    twice = next((path for i, path in enumerate(checkpoints) if resolved[i] in resolved[:i]), None)
    if twice is not None:  # a run and its checkpoints folder, or one path written two ways, too
        raise BlockloopError(f"--checkpoint {twice} names a checkpoint given before; give each once")
    for path in checkpoints:
        trained = load_trained(path, device)
        name = checkpoint_name(path, {m.name for m in models})
        objective = trained.state.get("train_config", {}).get("objective", "lm")
        measure = f"{spec_of(trained.config).loss_scores(objective)}, {trained.tokenizer.name} tokens"
        models.append(BenchModel(name, trained.model.to(dtype), last_val_loss(Path(path)), trained.tokenizer, measure))
    if not models:
        raise BlockloopError("nothing to bench: give --presets or --checkpoint")
    return models


def checkpoint_name(path: str, taken: set[str]) -> str:
    """A checkpoint's name in tables, ratios and plots: its run folder's name, with as many parent folders as it
    takes to tell it from the models before it (two runs' ``final`` folders, a run named like a preset); two
    checkpoints of one run add their ``step_*`` names."""
    run, given = run_folder(Path(path)), Path(path).resolve()
    suffixes = ["/".join(given.parts[-k:]) for k in range(1, len(given.parts) + 1)]
    if given.name.startswith("step_"):
        suffixes = [run.name, f"{run.name}/{given.name}", *suffixes]
    elif given != run:  # the run's checkpoints folder: its latest checkpoint, named as the run is
        suffixes = ["/".join(run.parts[-k:]) for k in range(1, len(run.parts) + 1)]
    for name in suffixes:
        if name not in taken:
            return name
    raise BlockloopError(f"--checkpoint {path} is given more than once; name each model once")


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
    warmup_tokens: int | None = None  # generated by a warm-up run (None: gen_len)
    # The KV caches to time each model over: "static" (its steps' keys cut to key lengths, ``key_buckets``),
    # "whole-keys" (static, every slot read each step: the engine before key lengths), "paged" (where the runner pages),
    # "paged-kernel" (the same pages read by blockloop's Triton kernel, read="kernel": CUDA only).
    caches: tuple[str, ...] = ("static",)
    key_buckets: int = KEY_BUCKETS

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise BlockloopError("--repeats must be >= 1 and --warmup >= 0")
        unknown = set(self.caches) - set(CACHES)
        if unknown:
            raise BlockloopError(f"unknown KV cache {', '.join(sorted(unknown))}; choose from {', '.join(CACHES)}")


def throughput_rows(models: list[BenchModel], settings: ThroughputSettings, bandwidth: float,
                    on_row: Callable[[dict[str, Any]], None] | None = None,
                    on_note: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per model and batch size, with ``ratio_vs_baseline`` to the first model at the same batch;
    ``on_row`` sees each row as it is measured (a device call stopped at its time limit keeps what it printed), and
    ``on_note`` why a model's batches ended early (out of memory, or a search reaching ``max_batch``)."""
    s = settings
    rows: list[dict[str, Any]] = []

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)
    for m in models:
        for cache in [kind for kind in s.caches if not kind.startswith("paged") or pages_kv(m.model)]:
            name = m.name if cache == "static" else f"{m.name} {cache}"

            def one(batch: int, m: BenchModel = m, cache: str = cache, name: str = name) -> Any:
                result = engine_throughput(
                    m.model, name, batch, s.prompt_len, s.gen_len, repeats=s.repeats, warmup=s.warmup,
                    sync_every=s.sync_every, compile=s.compile, bandwidth=bandwidth, seed=s.seed,
                    paged=cache.startswith("paged"), paged_read="kernel" if cache == "paged-kernel" else None,
                    warmup_tokens=s.warmup_tokens, key_buckets=0 if cache == "whole-keys" else s.key_buckets)
                add({"kind": "throughput", "val_loss": m.val_loss, "val_loss_measure": m.val_loss_measure,
                     **result.to_dict()})  # as it is measured, not after the model's last batch
                return result
            stop = None if on_note is None else (lambda why, name=name: on_note(f"{name}: {why}"))
            search_batches(one, s.batches, search=s.search, max_batch=s.max_batch, on_stop=stop)
    if s.hf:
        for row in hf_rows(models[0].model, s):
            add(row)
    add_ratios(rows, models[0].name)
    return rows


def hf_rows(model: nn.Module, settings: ThroughputSettings) -> Iterator[dict[str, Any]]:
    """HF ``generate()`` on ``model``'s weights at each listed batch size (no search), one row as each is timed."""
    s = settings
    for batch in s.batches:
        yield {"kind": "throughput", "val_loss": None, **hf_throughput(
            model, batch, s.prompt_len, s.gen_len, repeats=s.repeats, warmup=s.warmup, seed=s.seed,
            warmup_tokens=s.warmup_tokens).to_dict()}


def add_ratios(rows: list[dict[str, Any]], baseline: str) -> None:
    """Set each row's ``ratio_vs_baseline``: its tok/s over the ``baseline`` model's at the same batch (None where
    the baseline has no row at that batch)."""
    base = {r["batch"]: r["tok_s"] for r in rows if r["name"] == baseline}
    for r in rows:
        r["ratio_vs_baseline"] = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None


def pages_kv(model: nn.Module) -> bool:
    """Whether ``model``'s runner can serve it over a paged KV cache (not one whose cache is rings already: a
    Transformer-XL's, which streams)."""
    return "paging" in inspect.signature(RUNNERS[model.config.family]).parameters and not runner_for(model).streams


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
    sync_every: int | None = None  # the engine's default for the device, as `serve` runs
    compile: bool = False
    key_buckets: int = KEY_BUCKETS  # compiled: one graph per row count and per key length, all before the stream
    seed: int = 0
    warmup: int = 1  # untimed rounds of one request per slot before each model's stream
    busy_rows: bool = True  # False: every step runs every slot (one compiled graph per server, not one per row count)
    exits: list[ExitRule] = field(default_factory=list)  # depth-wise early-exit rules for looped models
    speculations: list[Speculation] = field(default_factory=list)  # self-speculative decoding of looped models

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise BlockloopError(f"--requests must be >= 1, got {self.requests}")
        # a repeated setting would serve the same runner twice, under one row name
        for flag, names, what in (("--exit", [rule_name(r) for r in self.exits], "rule"),
                                  ("--speculate", [str(sp.k) for sp in self.speculations], "K")):
            twice = next((name for name in names if names.count(name) > 1), None)
            if twice is not None:
                raise BlockloopError(f"{flag} names {twice} more than once; give each {what} once")


def stream_rows(models: list[BenchModel], settings: StreamSettings) -> Iterator[dict[str, Any]]:
    """One row per served model, yielded as each finishes: serving metrics, and for depth-wise runs the mean
    exit loop, the simulated schedules (RRT appendix N) and greedy agreement with the sequence-wise run.

    Every runner and prompt is made, and every request checked against its model's context, before this returns:
    a bad setting fails before the first model runs, not after it."""
    s = settings
    if (s.exits or s.speculations) and not any(isinstance(runner_for(m.model), RecursiveRunner) for m in models):
        flags = " and ".join(flag for flag, given in (("--exit", s.exits), ("--speculate", s.speculations)) if given)
        raise BlockloopError(f"{flags} serve looped models only, and none of {', '.join(m.name for m in models)} is "
                             "looped; add one (e.g. --presets demo-recursive) or leave them out")
    served: list[tuple[str, Runner, BenchModel, str | None, list[list[int]]]] = []
    for m in models:
        runners = [(m.name, runner_for(m.model), None)]
        if isinstance(runners[0][1], RecursiveRunner):
            try:  # an option one looped model cannot take (a draft as deep as its loops): say which model
                runners += [(f"{m.name} depth-wise exit {rule_name(r)}", runner_for(m.model, exit_rule=r), m.name)
                            for r in s.exits]
                runners += [(f"{m.name} {speculation_name(sp)}", runner_for(m.model, speculation=sp), m.name)
                            for sp in s.speculations]
            except BlockloopError as exc:
                raise BlockloopError(f"{m.name}: {exc}") from None
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
                       rate=s.rate, sync_every=s.sync_every, seed=s.seed, compile=s.compile, key_buckets=s.key_buckets,
                       warmup=s.warmup, busy_rows=s.busy_rows)
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
        yield {"kind": "stream", "name": name, "val_loss": bench_model.val_loss,
               "val_loss_measure": bench_model.val_loss_measure, **m}
