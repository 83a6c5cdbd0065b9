"""Vanilla decoder vs Block Transformer: quality at equal tokens, KV-cache bytes, generation speed.

Four measurements, each with the vanilla baseline in the same run:

1. ``quality``: validation loss of ``--vanilla`` and ``--block`` presets (equal non-embedding parameters) trained on
   the same corpus for the same number of tokens with the shared trainer;
2. ``kv``: KV-cache bytes per sample of the paper-size models (pythia-85m vs block-85m, bf16) in the paper's
   prefill-heavy (2048 prompt / 128 generated) and decode-heavy (128 / 2048) settings, read off the
   static caches the models allocate (on the meta device, so nothing is computed);
3. ``speed``: generation throughput and time to first token of the two models through the shared
   ``generate`` in both settings scaled to their context, over a batch sweep: random-token prompts,
   EOS disabled, one warm-up, the median of ``--repeats`` timed runs (untrained weights unless
   ``quality`` ran in the same call: the cost does not depend on them);
4. ``sweep``: Figure 3's sweeps at tiny scale: the block preset's layers split block:token as
   1:3, 2:2, 3:1 (allocation ratio), and block lengths 2, 4, 8 at 2:2, each trained on the same tokens.

    .venv/bin/python benchmarks/block_vs_vanilla.py --parts quality,kv,speed,sweep --steps 300 --record

``--parts`` picks what to run; results go to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into
benchmarks/results/) as ``block_vs_vanilla_cpu.{json,md}``, where a later call replaces only the parts it ran.
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
from blockloop.cli.common import names, positive_float, positive_int, positive_ints
from blockloop.families import build_model, from_name
from blockloop.models.block import BlockTransformer
from blockloop.serve.generate import generate
from blockloop.train.run import RunSpec, prepare_run, sequences
from blockloop.train.trainer import TrainConfig, Trainer


def train(preset: str, args: argparse.Namespace, **overrides: object) -> tuple[torch.nn.Module, dict[str, float]]:
    spec = RunSpec(preset=preset, data=args.data, tokenizer="byte", model_overrides=overrides)
    run = prepare_run(spec, seed=0, show_progress=False)
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup_steps=args.steps // 20,
        eval_interval=args.steps, eval_batches=args.eval_batches, log_interval=max(1, args.steps // 10),
        ckpt_interval=args.steps, device="cpu", progress=False, seed=0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(run.model, run.model_config, run.tokenizer, *sequences(run.splits, args.seq_len), config,
                          Path(tmp), run_info=spec.to_dict())
        start = time.perf_counter()
        metrics = trainer.fit()
        seconds = time.perf_counter() - start
    model = trainer.model.eval()
    return model, {
        "preset": preset,
        "overrides": overrides,
        "non_embedding_parameters": model.num_parameters(non_embedding=True),
        "parameters": model.num_parameters(),
        "tokens": args.steps * args.batch_size * args.seq_len,
        "val_loss": metrics["val_loss"],
        "train_ms_per_step": 1000 * seconds / args.steps,
    }


def cache_bytes_per_sample(preset: str, prompt: int, generated: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of every static cache the model allocates to generate ``generated`` tokens after ``prompt``."""
    context = -(-(prompt + generated) // 64) * 64
    with torch.device("meta"):
        model = build_model(from_name(preset, context_length=max(context, 64))).to(dtype)
        block = isinstance(model, BlockTransformer)  # its two caches; a decoder's one over prompt and output
        caches = model.generation_caches(1, prompt, generated) if block else [model.allocate_cache(1, prompt + generated)]
    return sum(layer.k.nbytes + layer.v.nbytes for cache in caches for layer in cache.layers)


def time_generation(model: torch.nn.Module, batch: int, prompt: int, generated: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt), generator=g).tolist()

    def run(n: int) -> float:
        start = time.perf_counter()
        generate(model, prompts, n, temperature=0)
        return time.perf_counter() - start

    run(min(generated, 8))  # warm-up
    ttft = statistics.median(run(1) for _ in range(repeats))
    total = statistics.median(run(generated) for _ in range(repeats))
    return {
        "batch": batch,
        "tokens_per_s": batch * generated / total,
        "ttft_ms": 1000 * ttft,
        "ms_per_token": 1000 * (total - ttft) / max(1, generated - 1),
    }


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=names(("quality", "kv", "speed", "sweep")), default="quality,kv,speed", help="any of quality, kv, speed, sweep (comma-separated)")
    parser.add_argument("--vanilla", default="demo")
    parser.add_argument("--block", default="demo-block")
    parser.add_argument("--data", default="shakespeare")
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--seq-len", type=positive_int, default=256)
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--eval-batches", type=positive_int, default=20)
    parser.add_argument("--batches", type=positive_ints, default="1,8,32")
    parser.add_argument("--repeats", type=positive_int, default=3)
    add_output_arguments(parser)
    args = parser.parse_args()
    parts = set(args.parts)

    out = output_dir(args)
    path = out / "block_vs_vanilla_cpu.json"
    record = json.loads(path.read_text()) if path.is_file() else {"benchmark": "block_vs_vanilla", "parts": {}}
    stamp = {**environment("cpu"), "settings": vars(args) | {"out_dir": str(out)}}

    models: dict[str, torch.nn.Module] = {}
    if "quality" in parts:
        rows = []
        for preset in (args.vanilla, args.block):
            models[preset], result = train(preset, args)
            rows.append(result)
            print(json.dumps(result), flush=True)
        record["parts"]["quality"] = {**stamp, "rows": rows}

    if "kv" in parts:
        settings = {"prefill-heavy 2048/128": (2048, 128), "decode-heavy 128/2048": (128, 2048)}
        rows = [{"setting": s, "preset": p, "bytes": cache_bytes_per_sample(p, prompt, gen)}
                for s, (prompt, gen) in settings.items() for p in ("pythia-85m", "block-85m")]
        record["parts"]["kv"] = {**stamp, "rows": rows}

    if "speed" in parts:
        for preset in (args.vanilla, args.block):  # speed does not depend on the weights: untrained is fine
            models.setdefault(preset, build_model(from_name(preset)).eval())
        context = min(m.config.context_length for m in models.values())
        settings = {"prefill-heavy": (context * 3 // 4, context // 8), "decode-heavy": (context // 8, context * 3 // 4)}
        rows = []
        for setting, (prompt, gen) in settings.items():
            for batch in args.batches:
                for preset in (args.vanilla, args.block):
                    row = {"setting": f"{setting} {prompt}/{gen}", "preset": preset,
                           **time_generation(models[preset], batch, prompt, gen, args.repeats),
                           "kv_bytes_per_sample": cache_bytes_per_sample(preset, prompt, gen, torch.float32)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        record["parts"]["speed"] = {**stamp, "rows": rows}

    if "sweep" in parts:
        base = from_name(args.block)
        layers = base.block_n_layer + base.token_n_layer
        runs = [{}] + [{"block_n_layer": b, "token_n_layer": layers - b} for b in range(1, layers) if b != base.block_n_layer]
        runs += [{"block_len": lb, "embed_dim": base.block_d_model // lb} for lb in (2, 8)]
        rows = []
        for overrides in runs:
            _, result = train(args.block, args, **overrides)
            rows.append(result)
            print(json.dumps(result), flush=True)
        record["parts"]["sweep"] = {**stamp, "rows": rows}

    path.write_text(json.dumps(record, indent=2) + "\n")
    (out / "block_vs_vanilla_cpu.md").write_text(render(record))
    print(render(record))


def render(record: dict) -> str:
    parts = record["parts"]
    lines = ["# Vanilla vs Block Transformer (CPU, scaled down)", "",
             "Each part names the machine, command and date it was measured with; compare speeds within a part.", ""]

    def header(title: str, part: dict) -> None:
        lines.extend([f"## {title}", "", f"- {environment_line(part)}", ""])

    if "quality" in parts:
        p = parts["quality"]
        header(f"Quality at equal tokens ({p['settings']['data']}, byte tokenizer, {p['settings']['steps']} steps)", p)
        lines += ["| model | non-emb params | params | tokens | val loss (nats/byte) | train ms/step |", "|---|---|---|---|---|---|"]
        for r in p["rows"]:
            lines.append(f"| {r['preset']} | {r['non_embedding_parameters']:,} | {r['parameters']:,} | {r['tokens']:,} "
                         f"| {r['val_loss']:.4f} | {r['train_ms_per_step']:.0f} |")
        lines += ["", "The block model's validation loss is over the tokens it predicts: every block but the first of "
                  "each window; pads from random-length padding are not scored.", ""]
    if "kv" in parts:
        p = parts["kv"]
        header("KV-cache bytes per sample, paper-size models (bf16, read off the allocated caches)", p)
        lines += ["| setting | pythia-85m | block-85m | block / vanilla |", "|---|---|---|---|"]
        for setting in dict.fromkeys(r["setting"] for r in p["rows"]):
            v, b = (next(r["bytes"] for r in p["rows"] if r["setting"] == setting and r["preset"] == m)
                    for m in ("pythia-85m", "block-85m"))
            lines.append(f"| {setting} | {v / 2**20:.1f} MiB | {b / 2**20:.1f} MiB | {b / v:.3f} |")
        lines.append("")
    if "speed" in parts:
        p = parts["speed"]
        vanilla = p["settings"]["vanilla"]
        header("Generation through the shared engine (greedy, EOS disabled, random prompts, median of repeats)", p)
        lines += ["| setting | batch | model | tokens/s | vs vanilla | TTFT ms | vs vanilla | ms/token | KV bytes/sample (fp32) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in p["rows"]:
            base = next(x for x in p["rows"] if x["setting"] == r["setting"] and x["batch"] == r["batch"] and x["preset"] == vanilla)
            lines.append(f"| {r['setting']} | {r['batch']} | {r['preset']} | {r['tokens_per_s']:,.0f} | "
                         f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['ttft_ms']:.1f} | "
                         f"{r['ttft_ms'] / base['ttft_ms']:.2f}x | {r['ms_per_token']:.2f} | {r['kv_bytes_per_sample']:,} |")
        lines.append("")
    if "sweep" in parts:
        p = parts["sweep"]
        header(f"Figure 3 at tiny scale ({p['settings']['block']}, {p['settings']['steps']} steps each, same tokens)", p)
        lines += ["| block:token layers | L_B | non-emb params | val loss | train ms/step |", "|---|---|---|---|---|"]
        for r in p["rows"]:
            c = from_name(p["settings"]["block"], **r["overrides"])
            lines.append(f"| {c.block_n_layer}:{c.token_n_layer} | {c.block_len} | {r['non_embedding_parameters']:,} "
                         f"| {r['val_loss']:.4f} | {r['train_ms_per_step']:.0f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    run_script(main)
