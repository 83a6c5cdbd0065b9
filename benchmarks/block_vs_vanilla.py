"""Vanilla decoder vs Block Transformer: quality at equal tokens, KV-cache bytes, generation speed.

Three measurements, each with the vanilla baseline in the same run:

1. validation loss of ``--vanilla`` and ``--block`` presets (equal non-embedding parameters) trained on
   the same corpus for the same number of tokens with the shared trainer;
2. KV-cache bytes per sample of the paper-size models (pythia-85m vs block-85m, bf16) in the paper's
   prefill-heavy (2048 prompt / 128 generated) and decode-heavy (128 / 2048) settings, read off the
   static caches the models allocate (on the meta device, so nothing is computed);
3. generation throughput and time to first token of the two trained models through the shared
   ``generate`` in both settings scaled to their context, over a batch sweep: random-token prompts,
   EOS disabled, one warm-up, the median of ``--repeats`` timed runs;
4. with ``--sweep``, Figure 3's sweeps at tiny scale: the block preset's layers split block:token as
   1:3, 2:2, 3:1 (allocation ratio), and block lengths 2, 4, 8 at 2:2, each trained on the same tokens.

    PYTHONPATH=src python benchmarks/block_vs_vanilla.py --steps 300

Writes markdown + JSON to --out-dir (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from blockloop.infer.generate import generate
from blockloop.models import build_model
from blockloop.presets import from_name
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
        caches = model.generation_caches(1, prompt, generated)
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vanilla", default="demo")
    parser.add_argument("--block", default="demo-block")
    parser.add_argument("--data", default="shakespeare")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="also run the allocation-ratio and block-length sweeps")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    quality, models = [], {}
    for preset in (args.vanilla, args.block):
        models[preset], result = train(preset, args)
        quality.append(result)
        print(json.dumps(result), flush=True)

    paper = {
        setting: {p: cache_bytes_per_sample(p, prompt, gen) for p in ("pythia-85m", "block-85m")}
        for setting, (prompt, gen) in {"prefill-heavy 2048/128": (2048, 128), "decode-heavy 128/2048": (128, 2048)}.items()
    }
    context = min(models[p].config.context_length for p in models)
    settings = {"prefill-heavy": (context * 3 // 4, context // 8), "decode-heavy": (context // 8, context * 3 // 4)}
    speed = []
    for setting, (prompt, gen) in settings.items():
        for batch in [int(b) for b in args.batches.split(",")]:
            for preset, model in models.items():
                row = {"setting": f"{setting} {prompt}/{gen}", "preset": preset, **time_generation(model, batch, prompt, gen, args.repeats),
                       "kv_bytes_per_sample": cache_bytes_per_sample(preset, prompt, gen, torch.float32)}
                speed.append(row)
                print(json.dumps(row), flush=True)

    sweep = []
    if args.sweep:
        base = from_name(args.block)
        layers = base.block_n_layer + base.token_n_layer
        runs = [{"block_n_layer": b, "token_n_layer": layers - b} for b in range(1, layers) if b != base.block_n_layer]
        runs += [{"block_len": lb, "embed_dim": base.block_d_model // lb} for lb in (2, 8)]
        for overrides in runs:
            _, result = train(args.block, args, **overrides)
            sweep.append(result)
            print(json.dumps(result), flush=True)

    record = {
        "benchmark": "block_vs_vanilla", "date": datetime.date.today().isoformat(), "device": "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "command": "PYTHONPATH=src python " + " ".join(sys.argv), "quality": quality, "paper_kv_bytes": paper,
        "generation": speed, "sweep": sweep,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "block_vs_vanilla_cpu.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out_dir / "block_vs_vanilla_cpu.md").write_text(render(record, args))
    print(render(record, args))


def render(record: dict, args: argparse.Namespace) -> str:
    lines = [
        "# Vanilla vs Block Transformer (CPU, scaled down)",
        "",
        f"- device: CPU ({record['threads']} threads); torch {record['torch']}; date {record['date']}",
        f"- command: `{record['command']}`",
        "- absolute speeds are CPU numbers; the GPU measurements of the paper's settings are owed (no GPU in this task)",
        "",
        f"## Quality at equal tokens ({args.data}, byte tokenizer)",
        "",
        "| model | non-emb params | params | tokens | val loss (nats/byte) | train ms/step |",
        "|---|---|---|---|---|---|",
    ]
    for r in record["quality"]:
        lines.append(f"| {r['preset']} | {r['non_embedding_parameters']:,} | {r['parameters']:,} | {r['tokens']:,} "
                     f"| {r['val_loss']:.4f} | {r['train_ms_per_step']:.0f} |")
    lines += ["", "The block model's validation loss is over the tokens it predicts (every block but the first of each "
              "window; pads from random-length padding are not scored).", "",
              "## KV-cache bytes per sample, paper-size models (bf16, from the allocated caches)", "",
              "| setting | pythia-85m | block-85m | block / vanilla |", "|---|---|---|---|"]
    for setting, sizes in record["paper_kv_bytes"].items():
        v, b = sizes["pythia-85m"], sizes["block-85m"]
        lines.append(f"| {setting} | {v / 2**20:.1f} MiB | {b / 2**20:.1f} MiB | {b / v:.3f} |")
    lines += ["", "## Generation through the shared engine (greedy, EOS disabled, median of repeats)", "",
              "| setting | batch | model | tokens/s | vs vanilla | TTFT ms | ms/token | KV bytes/sample (fp32) |",
              "|---|---|---|---|---|---|---|---|"]
    rows = record["generation"]
    for r in rows:
        base = next(x for x in rows if x["setting"] == r["setting"] and x["batch"] == r["batch"] and x["preset"] == args.vanilla)
        lines.append(f"| {r['setting']} | {r['batch']} | {r['preset']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['ttft_ms']:.1f} | {r['ms_per_token']:.2f} | "
                     f"{r['kv_bytes_per_sample']:,} |")
    if record["sweep"]:
        lines += ["", f"## Figure 3 at tiny scale ({args.block}, {args.steps} steps each, same tokens)", "",
                  "| block:token layers | L_B | non-emb params | val loss | train ms/step |", "|---|---|---|---|---|"]
        default = next(r for r in record["quality"] if r["preset"] == args.block)
        for r in [default, *record["sweep"]]:
            c = from_name(args.block, **r["overrides"])
            lines.append(f"| {c.block_n_layer}:{c.token_n_layer} | {c.block_len} | {r['non_embedding_parameters']:,} "
                         f"| {r['val_loss']:.4f} | {r['train_ms_per_step']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
