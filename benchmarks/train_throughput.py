"""Training throughput and MFU of a preset through blockloop's own trainer, eager vs torch.compile.

Runs the real :class:`~blockloop.train.trainer.Trainer` (bf16 autocast on CUDA, fused AdamW) for a few
dozen steps per variant on a built-in corpus and reads tokens/s from its own metrics log, skipping the
first logging window (warm-up and compilation). Eager is the baseline timed in the same run.

    .venv/bin/python benchmarks/train_throughput.py --preset pythia-85m --seq-len 2048 --batch-size 16 --record

Writes ``train_throughput_<preset>_<cpu|gpu>.{json,md}`` to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record``
into benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.cli import Parser
from blockloop.cli.common import device as device_name
from blockloop.cli.common import names, positive_int
from blockloop.device import resolve_device
from blockloop.families import spec_of
from blockloop.train.checkpoint import read_metrics
from blockloop.train.flops import peak_flops
from blockloop.train.run import RunSpec, prepare_run, sequences
from blockloop.train.trainer import TrainConfig, Trainer


def run_variant(args: argparse.Namespace, compile_model: bool, out: Path) -> dict[str, float]:
    spec = RunSpec(preset=args.preset, data=args.data, tokenizer=args.tokenizer)
    run = prepare_run(spec, seed=0, show_progress=False)
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=6e-4, warmup_steps=5,
        eval_interval=10**9, log_interval=args.log_interval, ckpt_interval=10**9, device=args.device,
        compile=compile_model, progress=False,
    )
    train, val = sequences(run.splits, args.seq_len)
    trainer = Trainer(run.model, run.model_config, run.tokenizer, train, None, config, out, run_info=spec.to_dict())
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    lines = [m for m in read_metrics(out / "metrics.jsonl") if "loss" in m]  # training records, not validation's
    windows = [m["tokens_per_s"] for m in lines if "tokens_per_s" in m][1:]  # skip warm-up/compile window
    tokens_per_s = statistics.median(windows)
    result = {
        "variant": "compiled" if compile_model else "eager",
        "tokens_per_s": tokens_per_s,
        "step_ms": 1000 * config.batch_size * config.seq_len / tokens_per_s,
        "first_loss": lines[0]["loss"],
        "last_loss": lines[-1]["loss"],
        "wall_s": wall,
        "parameters": run.model.num_parameters(),
        "non_embedding_parameters": run.model.num_parameters(non_embedding=True),
    }
    peak = peak_flops(trainer.device)
    if peak:
        result["mfu"] = spec_of(run.model_config).training_flops_per_token(run.model_config, args.seq_len) * tokens_per_s / peak
    if trainer.device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="pythia-85m")
    parser.add_argument("--data", default="shakespeare")
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--seq-len", type=positive_int, default=2048)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument("--log-interval", type=positive_int, default=10)
    parser.add_argument("--device", type=device_name, default="auto")
    parser.add_argument("--variants", type=names(("eager", "compiled")), default="eager,compiled")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.steps < 2 * args.log_interval:  # the first logged window holds warm-up and compilation: not timed
        parser.error(f"--steps {args.steps} must be at least twice --log-interval {args.log_interval}, so that "
                     "one timed window follows the warm-up window")
    out = output_dir(args)

    results = []
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run_variant(args, variant == "compiled", Path(tmp)))
        print(json.dumps(results[-1]), flush=True)
    device = resolve_device(args.device)
    record = {
        "benchmark": "train_throughput",
        **environment(device),
        "settings": vars(args) | {"out_dir": str(out)},
        "results": results,
    }
    stem = f"train_throughput_{args.preset}_{'gpu' if device.startswith('cuda') else 'cpu'}"
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    base = results[0]["tokens_per_s"]
    lines = [
        f"# Training throughput: {args.preset}, seq {args.seq_len}, batch {args.batch_size}",
        "",
        f"- {environment_line(record)}",
        f"- data: {args.data} with the {args.tokenizer} tokenizer; bf16 autocast on CUDA; {args.steps} steps, "
        f"median of {args.log_interval}-step windows after the first",
        "",
        "| variant | tokens/s | ms/step | vs eager | MFU | peak GiB | loss first -> last |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
        mem = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "n/a"
        lines.append(
            f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {r['tokens_per_s'] / base:.2f}x | {mfu} "
            f"| {mem} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} |"
        )
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    run_script(main)
