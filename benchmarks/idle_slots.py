"""What idle slots cost: one request, and a full load, on engines of 1, 8 and 16 slots (SmolLM2-135M, the
``demo-block`` Block Transformer, ``demo-recursive`` served depth-wise and speculatively, ``demo-staircase``), on
CPU or a GPU.

The engine steps a fixed number of rows per window (static shapes). Stepping every slot makes a lone request
on an 8-slot engine (``blockloop serve``'s default) pay for eight rows of weight matmuls and attention; stepping
only the busy prefix of the slots (``Runner.prefix_steps``, :func:`blockloop.serve.runners.base.row_buckets`)
makes it pay for one. Both are timed here in one process, alternating run by run: "prefix" is the engine as
shipped, "every slot" the same engine made to step all its slots (``engine.row_counts = [n_slots]``, the
engine's behaviour before prefix steps). The baseline is the 1-slot engine, timed in the same runs.
``--models`` names ``smollm2`` (the imported SmolLM2-135M-Instruct) and presets (random weights: the time does
not depend on them), each optionally served by another runner: ``demo-recursive:depthwise`` (continuous
depth-wise batching, every token running every loop), ``demo-recursive:speculative`` (self-speculative rounds).

    .venv/bin/python benchmarks/idle_slots.py --threads 1 --record              # CPU, float32
    .venv/bin/python benchmarks/idle_slots.py --device cuda --compile --record \
        --models pythia-85m,block-85m,demo-recursive:depthwise,demo-recursive:speculative,demo-staircase
                                                   # a GPU: bfloat16, CUDA graphs (SmolLM2's weights stay here)

Writes ``idle_slots_cpu.json`` (``idle_slots_cuda.json``) to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into
benchmarks/results/) and prints it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.bench.suite import bench_dtype
from blockloop.cli import Parser
from blockloop.cli.common import add_threads, positive_int, positive_ints, set_threads
from blockloop.cli.common import device as device_name
from blockloop.convert.smollm2 import import_smollm2
from blockloop.data.pretrained import SMOLLM2_GGUF
from blockloop.device import resolve_device
from blockloop.families import build_model, from_name
from blockloop.serve.engine import Engine
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import ExitRule, Speculation, runner_for

RUNNERS: dict[str, dict[str, object]] = {
    "": {}, "depthwise": {"exit_rule": ExitRule("none")}, "speculative": {"speculation": Speculation(k=2)},
}


def run_engine(engine: Engine, prompts: list[list[int]], gen_len: int) -> tuple[float, list[list[int]]]:
    """Seconds for ``engine`` to serve ``prompts`` (submitted together) to ``gen_len`` greedy tokens each, and
    their outputs (each window ends on a host copy of its tokens, so the clock stops after the GPU's work)."""
    requests = [engine.submit(p, gen_len, sampling=SamplingParams(temperature=0.0)) for p in prompts]
    start = time.perf_counter()
    engine.run()
    return time.perf_counter() - start, [r.output for r in requests]


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,demo-block,demo-recursive:depthwise,demo-recursive:speculative,demo-staircase",
                        help="comma-separated: smollm2 and/or presets, each optionally NAME:RUNNER "
                             f"(RUNNER one of {', '.join(RUNNERS)})")
    parser.add_argument("--slots", type=positive_ints, default="8,16", help="comma-separated engine sizes to compare with 1 slot")
    parser.add_argument("--prompt-len", type=positive_int, default=64)
    parser.add_argument("--gen-len", type=positive_int, default=64)
    parser.add_argument("--max-len", type=positive_int, default=256, help="engine max_len (tokens per slot)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per variant (after one warm-up)")
    add_threads(parser)
    parser.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda or auto (default: cpu)")
    parser.add_argument("--compile", action="store_true", help="compile the decode steps (CUDA graphs on CUDA)")
    add_output_arguments(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    device = resolve_device(args.device)
    torch._dynamo.config.recompile_limit = 64  # several engines of one runner class, a few row counts each
    dtype = bench_dtype("auto", device)
    out = output_dir(args)
    rows = []
    for served in args.models.split(","):
        name, _, runner = served.partition(":")
        if runner not in RUNNERS:
            parser.error(f"unknown runner {runner!r} in {served!r}; choose one of {', '.join(RUNNERS)}")
        rows += compare(load_model(name).to(device=device, dtype=dtype), served, RUNNERS[runner], args)
    result = {"prompt_len": args.prompt_len, "gen_len": args.gen_len, "max_len": args.max_len, "repeats": args.repeats,
              "compile": args.compile, "rows": rows, **environment(device, dtype)}
    (out / f"idle_slots_{torch.device(device).type}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(environment_line(result))


def load_model(name: str) -> torch.nn.Module:
    if name == "smollm2":
        return import_smollm2()
    torch.manual_seed(0)
    return build_model(from_name(name)).eval()


def compare(model: torch.nn.Module, name: str, options: dict[str, object],
            args: argparse.Namespace) -> list[dict[str, object]]:
    """One row per engine size and load: every-slot vs prefix steps (and vs 1 slot for a lone request), the
    model served by ``runner_for(model, **options)``."""
    generator = torch.Generator().manual_seed(0)
    new_engine = lambda slots: Engine(runner_for(model, **options), slots, max_len=args.max_len,  # noqa: E731
                                      compile=args.compile)
    single, rows = new_engine(1), []  # engines are reused run after run, as a server does: compiled once
    for slots in args.slots:
        engines = {"every slot": new_engine(slots), "prefix": new_engine(slots)}
        engines["every slot"].row_counts = [slots]
        for load in (1, slots):
            variants = {"every slot": engines["every slot"], "prefix": engines["prefix"]}
            if load == 1:  # the baseline: what one request costs with no idle slot at all
                variants = {"1 slot": single, **variants}
            seconds: dict[str, list[float]] = {variant: [] for variant in variants}
            agree = True
            for run in range(args.repeats + 1):
                prompts = torch.randint(0, model.config.vocab_size, (load, args.prompt_len), generator=generator).tolist()
                outputs = []
                for variant, engine in variants.items():
                    took, out_tokens = run_engine(engine, prompts, args.gen_len)
                    outputs.append(out_tokens)
                    if run:
                        seconds[variant].append(took)
                agree &= outputs[-2] == outputs[-1]  # the same rows of the same engine: prefix steps change no token
            mean = {variant: sum(v) / len(v) for variant, v in seconds.items()}
            row = {"model": name.replace("smollm2", SMOLLM2_GGUF), "slots": slots, "requests": load,
                   "seconds": seconds,
                   "every_slot_vs_prefix": mean["every slot"] / mean["prefix"], "same_tokens": agree}
            line = f"{name}, {slots} slots, {load} request(s): every slot / prefix {row['every_slot_vs_prefix']:.2f}x"
            if "1 slot" in mean:
                row["every_slot_vs_1_slot"] = mean["every slot"] / mean["1 slot"]
                row["prefix_vs_1_slot"] = mean["prefix"] / mean["1 slot"]
                line += (f"; vs the 1-slot engine: every slot {row['every_slot_vs_1_slot']:.2f}x, "
                         f"prefix {row['prefix_vs_1_slot']:.2f}x")
            rows.append(row)
            print(f"{line}; same tokens {agree}", flush=True)
    return rows


if __name__ == "__main__":
    run_script(main)
