"""Staircase attention results at CPU scale: state-tracking task error (Table 1) and bits per character vs steps (Figure 3).

Two parts, every model trained by the shared trainer through the same path as ``blockloop train``:

1. ``tasks``: each ``--models`` entry trained on ``--task`` (Random Walk or Algorithm, usually a shortened
   ``NAME:LENGTH`` variant); recorded: parameters, the task error (argmax error over labelled positions,
   as the paper) on the valid and test splits, and the training time per batch (median over steps, as
   Table 2's "train batch time"). The baseline is a plain 2-layer transformer with the same layers as the
   recurrent models' core (``tiny`` with full multi-head attention), so every row has the same parameters.
2. ``lm``: character-level language modelling on a built-in corpus (byte tokenizer: one id per
   character for ASCII text): validation bits per character against the number of recurrent steps at
   fixed parameters, for Staircase (step size S fixed, forward size C = S / steps) and Ladder (the core
   repeated), as Figure 3.

    .venv/bin/python benchmarks/staircase_tasks.py tasks --task random-walk:16 --seq-len 68 --steps 300 --record
    .venv/bin/python benchmarks/staircase_tasks.py tasks --task algorithm-3:8 --seq-len 96 --steps 300 --record
    .venv/bin/python benchmarks/staircase_tasks.py lm --steps 300 --record

Model entries are ``LABEL=PRESET[,FIELD=VALUE...]`` (values read as JSON). Results go to runs/bench/
(``--out-dir DIR`` elsewhere, ``--record`` into benchmarks/results/) as ``staircase_tasks_cpu.{json,md}``,
one table per task (and ``lm``); a later call replaces only the rows (by label) it ran, and each row keeps
the machine, command, date and settings it was measured with.
Tasks are generated with seed 0 and their default sizes into the blockloop cache (as ``--task`` does).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from blockloop.bench.records import add_output_arguments, environment, environment_line, output_dir
from blockloop.families import from_name
from blockloop.train.evaluate import evaluate
from blockloop.train.run import RunSpec, prepare_run, sequences, task_sequences
from blockloop.train.trainer import TrainConfig, Trainer

TASK_MODELS = (
    "transformer=tiny,n_kv_head=4",
    "staircase=tiny-staircase",
    "cached-staircase=tiny-cached-staircase",
    "ladder-2=tiny-ladder",
    "ladder-4=tiny-ladder,n_steps=4",
    "feedback=tiny-feedback",
)
# Figure 3 at tiny scale: the same 2-layer core, 1/2/4 recurrent steps; Staircase keeps S = 32 and
# shrinks the forward size C = S / steps (one step: S = C, each chunk alone).
LM_MODELS = (
    "staircase-1=tiny-staircase,step_size=32,chunk_size=32",
    "staircase-2=tiny-staircase,step_size=32,chunk_size=16",
    "staircase-4=tiny-staircase,step_size=32,chunk_size=8",
    "ladder-1=tiny-ladder,n_steps=1",
    "ladder-2=tiny-ladder,n_steps=2",
    "ladder-4=tiny-ladder,n_steps=4",
)
RESULTS = "staircase_tasks_cpu"
OBSERVATIONS = "## Observations"


def parse_model(entry: str) -> tuple[str, str, dict[str, object]]:
    label, _, rest = entry.partition("=")
    preset, *fields = rest.split(",")
    overrides: dict[str, object] = {}
    for item in fields:
        name, _, value = item.partition("=")
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name] = value
    return label, preset, overrides


def train_one(entry: str, spec_fields: dict[str, object], args: argparse.Namespace) -> dict[str, object]:
    """Train one model entry with the shared trainer; time each step; return its record (model kept for eval)."""
    label, preset, overrides = parse_model(entry)
    context = from_name(preset, **overrides).context_length
    if context < args.seq_len:
        overrides["context_length"] = args.seq_len
    spec = RunSpec(preset=preset, model_overrides=overrides, **spec_fields)
    run = prepare_run(spec, seed=args.seed, show_progress=False)
    train, val = sequences(run.splits, args.seq_len)
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        warmup_steps=max(1, args.steps // 10), eval_interval=args.steps, eval_batches=1,
        log_interval=max(1, args.steps // 5), ckpt_interval=10 * args.steps, device="cpu", progress=False,
        seed=args.seed,
    )
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(run.model, run.model_config, run.tokenizer, train, None, config, Path(tmp), run_info=spec.to_dict())
        start = time.perf_counter()
        metrics = trainer.fit(on_step=lambda step, m: stamps.append(time.perf_counter()))
        seconds = time.perf_counter() - start
    durations = [b - a for a, b in itertools.pairwise(stamps)]
    record = {
        "label": label,
        "preset": preset,
        "overrides": overrides,
        "summary": run.model_config.summary(),
        "parameters": run.model.num_parameters(),
        "final_train_loss": metrics["loss"],
        "train_ms_per_batch": 1000 * statistics.median(durations),
        "train_seconds": seconds,
    }
    return record | {"_model": trainer.model.eval(), "_run": run, "_val": val}


def run_tasks(args: argparse.Namespace, save: Callable[[dict[str, object]], None]) -> dict[str, object]:
    rows = []
    for entry in args.models or TASK_MODELS:
        record = train_one(entry, {"task": args.task}, args)
        model, run = record.pop("_model"), record.pop("_run")
        record.pop("_val")
        for split in ("valid", "test"):
            result = evaluate(model, task_sequences(run.splits, split, args.seq_len), batch_size=args.batch_size,
                              max_batches=args.eval_batches)
            record[f"{split}_error"] = result["error"]
            record[f"{split}_labelled"] = int(result["tokens"])
        record["run"] = provenance(args)
        print(json.dumps(record), flush=True)
        rows.append(record)
        save({"kind": "task", "rows": rows})
    return {"kind": "task", "rows": rows}


def run_lm(args: argparse.Namespace, save: Callable[[dict[str, object]], None]) -> dict[str, object]:
    rows = []
    for entry in args.models or LM_MODELS:
        record = train_one(entry, {"data": args.data, "tokenizer": "byte"}, args)
        model, run, val = record.pop("_model"), record.pop("_run"), record.pop("_val")
        result = evaluate(model, val, batch_size=args.batch_size, max_batches=args.eval_batches,
                          byte_lengths=run.tokenizer.token_byte_lengths())
        _, _, _overrides = parse_model(entry)
        config = run.model_config
        steps = {"staircase": "passes", "ladder": "n_steps"}.get(config.family)
        steps = getattr(config, steps) if steps else 1
        record.update(recurrent_steps=steps, val_bits_per_char=result["bits_per_byte"], val_tokens=int(result["tokens"]))
        record["run"] = provenance(args) | {"data": args.data}
        print(json.dumps(record), flush=True)
        rows.append(record)
        save({"kind": "lm", "rows": rows})
    return {"kind": "lm", "rows": rows}


def provenance(args: argparse.Namespace) -> dict[str, object]:
    return {
        **environment("cpu"),
        "settings": {k: getattr(args, k) for k in ("steps", "batch_size", "seq_len", "lr", "seed", "eval_batches")},
    }


def markdown(record: dict[str, dict[str, object]]) -> str:
    lines = [
        "# Staircase family on state-tracking tasks and character-level LM (CPU, scaled down)",
        "",
        ("Everything is shrunk to CPU scale: 2-layer d=64 cores (~0.11M parameters), shortened tasks "
         "(`NAME:LENGTH`), a few hundred steps, one seed (the paper picks the best of several). Train times are "
         "medians per batch: compare them within one command's rows only (each line names its machine)."),
        "",
    ]
    for key, part in record.items():
        if "rows" not in part:  # an entry written by hand (notes on a longer run): kept in the JSON, not tabled
            continue
        lines += [f"## {key}", ""]
        # One line per command: its rows were measured one after another (dates: first to last finished).
        runs: dict[str, list[dict[str, object]]] = {}
        for r in part["rows"]:
            runs.setdefault(r["run"]["command"], []).append(r)
        for command, rows in runs.items():
            run, s = rows[0]["run"], rows[0]["run"]["settings"]
            dates = sorted({r["run"]["date"] for r in rows})
            when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
            lines += [(f"- {', '.join(r['label'] for r in rows)}: {s['steps']} steps of batch {s['batch_size']} x "
                       f"{s['seq_len']} tokens, LR {s['lr']} (cosine), seed {s['seed']}; "
                       f"{environment_line(run | {'date': when})}")]
        lines.append("")
        if part["kind"] == "task":
            lines += ["| model | preset (overrides) | core | params | valid error | test error | train ms/batch |",
                      "|---|---|---|---|---|---|---|"]
            for r in part["rows"]:
                lines.append(
                    f"| {r['label']} | {r['preset']} {json.dumps(r['overrides'])} | {r['summary']} | {r['parameters']:,} "
                    f"| {r['valid_error']:.1%} | {r['test_error']:.1%} | {r['train_ms_per_batch']:.0f} |")
            rows = part["rows"]
            lines += ["", (f"Errors over {rows[0]['valid_labelled']:,} (valid) and {rows[0]['test_labelled']:,} (test) "
                      "labelled positions."), ""]
        else:
            lines += ["| model | recurrent steps | core | params | val bits/char | train ms/batch |",
                      "|---|---|---|---|---|---|"]
            for r in part["rows"]:
                lines.append(f"| {r['label']} | {r['recurrent_steps']} | {r['summary']} | {r['parameters']:,} "
                             f"| {r['val_bits_per_char']:.4f} | {r['train_ms_per_batch']:.0f} |")
            lines += ["", (f"Validation over the first {part['rows'][0]['val_tokens']:,} characters of the "
                      f"{part['rows'][0]['run']['data']} validation split."), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["tasks", "lm"])
    parser.add_argument("--task", default="random-walk:16", help="task for `tasks` (NAME or NAME:LENGTH)")
    parser.add_argument("--data", default="shakespeare", help="corpus for `lm` (byte tokenizer)")
    parser.add_argument("--models", nargs="+", help="LABEL=PRESET[,FIELD=VALUE...] entries (default: the part's list)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=20, help="evaluation batches per split")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    add_output_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    key = args.task if args.part == "tasks" else "lm"
    out = output_dir(args)

    def save(part: dict[str, object]) -> None:
        """Merge ``part`` into the results after every model, so an interrupted run keeps what it measured."""
        path = out / f"{RESULTS}.json"
        record = json.loads(path.read_text()) if path.is_file() else {}
        if key in record:  # keep the rows of models this call did not run
            ran = {row["label"] for row in part["rows"]}
            part = part | {"rows": [row for row in record[key]["rows"] if row["label"] not in ran] + part["rows"]}
        record[key] = part
        path.write_text(json.dumps(record, indent=2) + "\n")
        md = out / f"{RESULTS}.md"
        # The hand-written reading of the numbers (a section starting at OBSERVATIONS) survives re-runs.
        kept = md.read_text().partition(OBSERVATIONS)[2] if md.is_file() else ""
        md.write_text(markdown(record) + ("\n" + OBSERVATIONS + kept if kept else ""))

    part = run_tasks(args, save) if args.part == "tasks" else run_lm(args, save)
    print(markdown({key: part}))


if __name__ == "__main__":
    main()
