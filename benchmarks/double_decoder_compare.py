"""Decoder-only vs block-based double decoder vs encoder-decoder, as in the double-decoder paper.

Each family pretrains with its own objective (next token; block partitions; span corruption) on the same
token budget, at roughly matched non-embedding parameters, then takes the paper's PrefixLM fine-tuning
phase (section 4: 10% of the pretraining steps, base LR 2e-4, one breakpoint per batch, only the suffix
scored). The comparison is the PrefixLM validation loss, where all three score exactly the same tokens
(breakpoints come from the same seeded generators). Then inference through the shared ``generate``:
KV-cache bytes held by each model's decoding state, time to first token (a 1-token generate) and
per-token latency ((t_N - t_1) / (N - 1)), each as a ratio to decoder-only timed in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/double_decoder_compare.py --record

Writes double_decoder_compare_<cpu|gpu>.{json,md} to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into
benchmarks/results/).
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
from blockloop.bench.throughput import state_bytes
from blockloop.cli import Parser
from blockloop.cli.common import device as device_name
from blockloop.cli.common import nonnegative_int, positive_float, positive_int
from blockloop.serve.generate import generate
from blockloop.serve.runners import runner_for
from blockloop.train.evaluate import evaluate
from blockloop.train.run import RunSpec, prepare_run, sequences
from blockloop.train.trainer import TrainConfig, Trainer

FAMILIES = (("decoder-only", "demo"), ("double decoder", "demo-double"), ("encoder-decoder", "demo-encdec"))


def train_phase(run, out: Path, args: argparse.Namespace, *, objective: str, steps: int, lr: float) -> None:
    config = TrainConfig(
        steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=lr, warmup_steps=max(1, steps // 20),
        schedule="linear", eval_interval=10**9, log_interval=max(1, steps // 5), ckpt_interval=10**9,
        device=args.device, progress=False, seed=args.seed, objective=objective,
    )
    train, _ = sequences(run.splits, args.seq_len)
    Trainer(run.model, run.model_config, run.tokenizer, train, None, config, out).fit()


def timed_generate(model, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(model, prompts, new_tokens, temperature=0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cache_bytes(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> int:
    """Bytes of the decode state after a lock-step prefill of ``prompts`` (the encoder-decoder's cross K/V then
    cover the prompt, not a whole slot), counted as the engine throughput benchmark counts them."""
    idx = torch.tensor(prompts)
    runner = runner_for(model)
    runner.allocate(idx.shape[0], idx.shape[1] + new_tokens)
    runner.prefill_batch(idx, torch.ones_like(idx, dtype=torch.bool))
    return state_bytes(runner.state)


def run_family(label: str, preset: str, args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    print(f"=== {label} ({preset})", flush=True)
    run = prepare_run(RunSpec(preset=preset), seed=args.seed, show_progress=False)
    start = time.perf_counter()
    train_phase(run, workdir / preset / "pretrain", args, objective="lm", steps=args.steps, lr=args.lr)
    prefix_steps = max(1, args.steps // 10)
    train_phase(run, workdir / preset / "prefix_lm", args, objective="prefix_lm", steps=prefix_steps, lr=args.prefix_lr)
    train_seconds = time.perf_counter() - start
    _, val = sequences(run.splits, args.seq_len)
    metrics = evaluate(run.model, val, batch_size=args.batch_size, max_batches=args.eval_batches, objective="prefix_lm",
                       byte_lengths=run.tokenizer.token_byte_lengths())
    model = run.model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (args.gen_batch, args.prompt_len), generator=g).tolist()
    ttft = timed_generate(model, prompts, 1, args.repeats)
    total = timed_generate(model, prompts, args.new_tokens, args.repeats)
    return {
        "family": label, "preset": preset,
        "non_embedding_params": model.num_parameters(non_embedding=True), "params": model.num_parameters(),
        "pretrain_steps": args.steps, "prefix_lm_steps": prefix_steps, "train_seconds": train_seconds,
        "prefix_lm_val_loss": metrics["loss"], "prefix_lm_val_tokens": metrics["tokens"],
        "kv_cache_bytes": cache_bytes(model, prompts, args.new_tokens),
        "ttft_s": ttft, "per_token_s": (total - ttft) / (args.new_tokens - 1),
    }


def markdown(record: dict[str, object]) -> str:
    rows = record["results"]
    base = rows[0]
    lines = [
        "# Decoder-only vs double decoder vs encoder-decoder (PrefixLM loss, KV cache, latency)",
        "",
        f"- {environment_line(record)}",
        "",
        f"Byte-level Shakespeare, {record['settings']['steps']} pretraining steps of {record['settings']['batch_size']} x "
        f"{record['settings']['seq_len']} tokens with each family's own objective (LR {record['settings']['lr']}, linear "
        f"decay), then {rows[0]['prefix_lm_steps']} PrefixLM steps (LR {record['settings']['prefix_lr']}); validation: "
        f"PrefixLM loss (nats/byte) over the same {int(base['prefix_lm_val_tokens'])} suffix tokens for every family. "
        f"Generation: batch {record['settings']['gen_batch']}, prompt {record['settings']['prompt_len']}, "
        f"{record['settings']['new_tokens']} new tokens, greedy, fp32, median of {record['settings']['repeats']}.",
        "",
        "| family | preset | non-emb params | PrefixLM val loss | KV cache | vs decoder-only | TTFT | vs | per token | vs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | `{r['preset']}` | {r['non_embedding_params'] / 1e6:.3f}M | {r['prefix_lm_val_loss']:.4f} | "
            f"{r['kv_cache_bytes'] / 2**10:.0f} KiB | {r['kv_cache_bytes'] / base['kv_cache_bytes']:.2f}x | "
            f"{r['ttft_s'] * 1e3:.1f} ms | {r['ttft_s'] / base['ttft_s']:.2f}x | {r['per_token_s'] * 1e3:.2f} ms | "
            f"{r['per_token_s'] / base['per_token_s']:.2f}x |"
        )
    ranked = sorted(rows, key=lambda r: r["prefix_lm_val_loss"])
    order = " < ".join(f"{r['family']} {r['prefix_lm_val_loss']:.3f}" for r in ranked)
    lines += ["", f"PrefixLM loss ordering: {order} (paper, section 5: decoder-only <~ double decoder << encoder-decoder).",
              "", record["notes"], ""]
    return "\n".join(lines)


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=250)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--prefix-lr", type=positive_float, default=2e-4)
    parser.add_argument("--eval-batches", type=positive_int, default=40)
    parser.add_argument("--gen-batch", type=positive_int, default=8)
    parser.add_argument("--prompt-len", type=positive_int, default=128)
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--seed", type=nonnegative_int, default=0)
    add_output_arguments(parser)
    args = parser.parse_args()
    out = output_dir(args)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_family(label, preset, args, Path(tmp)) for label, preset in FAMILIES]
    for r in results:
        print(json.dumps(r), flush=True)
    record = {
        **environment(args.device), "settings": vars(args) | {"out_dir": str(out)},
        "results": results,
        "notes": (
            "Timings are compared as ratios to decoder-only timed in the same run. KV cache = the tensors of each "
            "model's decoding state after the prompt (fp32 here; K/V and which slots hold a key): all layers for "
            "decoder-only, the generation / decoder layers only (self + cross K/V) for the two-stack models."
        ),
    }
    stem = "double_decoder_compare_" + ("gpu" if args.device.startswith("cuda") else "cpu")
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    run_script(main)
