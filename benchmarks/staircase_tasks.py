"""Staircase attention results at CPU scale: state-tracking task error (Table 1) and bits per character vs steps (Figure 3).

Three parts, every model trained by the shared trainer through the same path as ``blockloop train``:

1. ``tasks``: each ``--models`` entry trained on ``--task`` (Random Walk or Algorithm, usually a shortened
   ``NAME:LENGTH`` variant); recorded: parameters, the task error (argmax error over labelled positions,
   as the paper) on the valid and test splits, and the training time per batch (median over steps, as
   Table 2's "train batch time"). The baseline is a plain 2-layer transformer with the same layers as the
   recurrent models' core (``tiny`` with full multi-head attention), so every row has the same parameters.
2. ``lm``: character-level language modelling on a built-in corpus (byte tokenizer: one id per
   character for ASCII text): validation bits per character against the number of recurrent steps at
   fixed parameters, for Staircase (step size S fixed, forward size C = S / steps) and Ladder (the core
   repeated), as Figure 3.
3. ``seeds``: every ``--models`` entry on ``--task`` from ``--seeds`` training seeds (same task data): final
   valid/test error and a test-error curve every ``--curve-every`` steps; mean ± sample std per model, the
   seed range and whether it lies wholly below the transformer's, in ``staircase_seeds_cpu.{json,md}`` with
   one figure per task (``staircase_seeds_cpu_TASK.png``). ``--smoke`` checks the protocol in seconds.

    .venv/bin/python benchmarks/staircase_tasks.py tasks --task random-walk:16 --seq-len 68 --steps 300 --record
    .venv/bin/python benchmarks/staircase_tasks.py tasks --task algorithm-3:8 --seq-len 96 --steps 300 --record
    .venv/bin/python benchmarks/staircase_tasks.py lm --steps 300 --record

Model entries are ``LABEL=PRESET[,FIELD=VALUE...]`` (values read as JSON). Results go to runs/bench/
(``--out-dir DIR`` elsewhere, ``--record`` into benchmarks/results/) as ``staircase_tasks_cpu.{json,md}``
(``seeds``: ``staircase_seeds_cpu.*``; ``_gpu`` instead of ``_cpu`` with ``--device cuda``),
one table per task (and ``lm``); a later call replaces only the rows (by label) it ran, and each row keeps
the machine, command, date and settings it was measured with.
Tasks are generated with seed 0 and their default sizes into the blockloop cache (as ``--task`` does).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from blockloop.bench.records import (
    add_output_arguments,
    environment,
    environment_line,
    output_dir,
    run_script,
)
from blockloop.cli import Parser
from blockloop.cli.common import add_threads, nonnegative_int, positive_float, positive_int, set_threads
from blockloop.cli.common import device as device_name
from blockloop.errors import BlockloopError
from blockloop.families import from_name, spec_of
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
# `seeds`: the four models of the issue's table; the Staircase and Cached Staircase with two passes' worth of
# chunks (S/C = 2, Table 7's best-supported Algorithm rows), the Ladder with two steps (the same compute).
SEED_MODELS = (
    "transformer=tiny,n_kv_head=4",
    "staircase=tiny-staircase-algorithm",
    "cached-staircase=tiny-cached-staircase-algorithm",
    "ladder=tiny-ladder",
)
SMOKE_MODELS = ("transformer=tiny,n_kv_head=4", "staircase=tiny-staircase-algorithm")
RESULTS = "staircase_tasks"
SEEDS_RESULTS = "staircase_seeds"
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


def check_models(entries: list[str], seq_len: int) -> None:
    """Every entry's preset and fields, and ``--seq-len`` against its chunk size, before the first model trains: each
    trains for minutes, and a typo in the last entry was found only after the others had run."""
    for entry in entries:
        label, preset, overrides = parse_model(entry)
        if not label or not preset:
            raise BlockloopError(f"--models {entry!r}: give LABEL=PRESET[,FIELD=VALUE...]")
        config = from_name(preset, **overrides)
        unit = spec_of(config).sequence_multiple(config)
        if seq_len % unit:
            raise BlockloopError(f"--models {entry}: --seq-len {seq_len} is not a multiple of its chunk size {unit}; "
                                 f"use e.g. --seq-len {-(-seq_len // unit) * unit}")


def train_one(
    entry: str, spec_fields: dict[str, object], args: argparse.Namespace, *, seed: int | None = None,
    curve_split: str | None = None,
) -> dict[str, object]:
    """Train one model entry with the shared trainer; time each step; return its record (model kept for eval).

    With ``curve_split`` (a task split) the record gets ``curve``: the task error on the first
    ``--curve-batches`` batches of that split every ``--curve-every`` steps (and at the last), with the
    training loss at that step; those evaluations are left out of the time per batch and the train time.
    """
    seed = args.seed if seed is None else seed
    label, preset, overrides = parse_model(entry)
    context = from_name(preset, **overrides).context_length
    if context < args.seq_len:
        overrides["context_length"] = args.seq_len
    spec = RunSpec(preset=preset, model_overrides=overrides, **spec_fields)
    run = prepare_run(spec, seed=seed, show_progress=False)
    train, val = sequences(run.splits, args.seq_len)
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        warmup_steps=max(1, args.steps // 10), eval_interval=args.steps, eval_batches=1,
        log_interval=max(1, args.steps // 5), ckpt_interval=10 * args.steps, device=args.device, progress=False,
        seed=seed,
    )
    probe = task_sequences(run.splits, curve_split, args.seq_len) if curve_split else None
    ends: list[float] = []  # when each step finished
    starts: list[float] = []  # when the next step could start (after the curve's evaluation, if any)
    curve: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(run.model, run.model_config, run.tokenizer, train, None, config, Path(tmp), run_info=spec.to_dict())

        def on_step(step: int, metrics: dict[str, float]) -> None:
            ends.append(time.perf_counter())
            if probe is not None and (step % args.curve_every == 0 or step == args.steps):
                result = evaluate(trainer.model, probe, batch_size=args.batch_size, max_batches=args.curve_batches,
                                  device=args.device)
                curve.append({"step": step, "train_loss": metrics["loss"], f"{curve_split}_error": result["error"]})
            starts.append(time.perf_counter())

        start = time.perf_counter()
        metrics = trainer.fit(on_step=on_step)
        seconds = time.perf_counter() - start - sum(s - e for e, s in zip(ends, starts))
    durations = [end - begin for begin, end in zip(starts, ends[1:])]
    record = {
        "label": label,
        "preset": preset,
        "overrides": overrides,
        "summary": run.model_config.summary(),
        "parameters": run.model.num_parameters(),
        "final_train_loss": metrics["loss"],
        "train_ms_per_batch": 1000 * statistics.median(durations),
        "train_seconds": seconds,
    } | ({"seed": seed, "curve": curve} if probe is not None else {})
    return record | {"_model": trainer.model.eval(), "_run": run, "_val": val}


def add_task_errors(record: dict[str, object], args: argparse.Namespace) -> None:
    """Replace ``train_one``'s kept model in ``record`` by its valid/test task errors and the run's provenance."""
    model, run = record.pop("_model"), record.pop("_run")
    record.pop("_val")
    for split in ("valid", "test"):
        result = evaluate(model, task_sequences(run.splits, split, args.seq_len), batch_size=args.batch_size,
                          max_batches=args.eval_batches, device=args.device)
        record[f"{split}_error"] = result["error"]
        record[f"{split}_labelled"] = int(result["tokens"])
    record["run"] = provenance(args)


def run_tasks(args: argparse.Namespace, save: Callable[[dict[str, object]], None]) -> dict[str, object]:
    rows = []
    for entry in args.models or TASK_MODELS:
        record = train_one(entry, {"task": args.task}, args)
        add_task_errors(record, args)
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
                          byte_lengths=run.tokenizer.token_byte_lengths(), device=args.device)
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


def run_seeds(args: argparse.Namespace, save: Callable[[dict[str, object]], None]) -> dict[str, object]:
    """Every ``--models`` entry trained from ``--seeds`` seeds on ``--task``: final valid/test error per seed and
    the test-error curve of each run (the training data is the same for all seeds; the seed draws the
    initial weights and the batch order, as the paper's training seeds)."""
    rows = []
    for entry in args.models or SEED_MODELS:
        for seed in range(args.seed, args.seed + args.seeds):
            record = train_one(entry, {"task": args.task}, args, seed=seed, curve_split="test")
            add_task_errors(record, args)
            print(json.dumps({k: v for k, v in record.items() if k != "curve"}), flush=True)
            rows.append(record)
            save({"kind": "seeds", "rows": rows})
    return {"kind": "seeds", "rows": rows}


def seed_summary(rows: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    """Per model label: seeds, mean and sample std of the test (and valid) error, and the test range."""
    by_label: dict[str, list[dict[str, object]]] = {}
    for r in rows:
        by_label.setdefault(r["label"], []).append(r)
    summary = {}
    for label, runs in by_label.items():
        test = [r["test_error"] for r in runs]
        valid = [r["valid_error"] for r in runs]
        summary[label] = {
            "seeds": sorted(r["seed"] for r in runs), "preset": runs[0]["preset"], "overrides": runs[0]["overrides"],
            "summary": runs[0]["summary"], "parameters": runs[0]["parameters"],
            "test_mean": statistics.fmean(test), "test_std": statistics.stdev(test) if len(test) > 1 else 0.0,
            "test_min": min(test), "test_max": max(test),
            "valid_mean": statistics.fmean(valid), "valid_std": statistics.stdev(valid) if len(valid) > 1 else 0.0,
            "train_ms_per_batch": statistics.median(r["train_ms_per_batch"] for r in runs),
            "final_train_loss_mean": statistics.fmean(r["final_train_loss"] for r in runs),
        }
    return summary


def seeds_markdown(key: str, part: dict[str, object], results: str) -> list[str]:
    """The mean ± std table of one task, with each model's seed range and how it compares with the transformer."""
    summary = seed_summary(part["rows"])
    baseline = summary.get("transformer")
    lines = ["| model | preset (overrides) | core | params | seeds | test error mean ± std | test range (min-max) "
             "| valid error mean ± std | final train loss (mean) | train ms/batch | vs transformer |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, m in summary.items():
        if baseline is None or label == "transformer":
            verdict = ""
        elif m["test_max"] < baseline["test_min"]:
            verdict = "lower, ranges apart"
        elif m["test_mean"] < baseline["test_mean"]:
            verdict = "lower mean, ranges overlap"
        else:
            verdict = "not lower"
        lines.append(
            f"| {label} | {m['preset']} {json.dumps(m['overrides'])} | {m['summary']} | {m['parameters']:,} "
            f"| {len(m['seeds'])} | {m['test_mean']:.1%} ± {m['test_std']:.1%} | {m['test_min']:.1%}-{m['test_max']:.1%} "
            f"| {m['valid_mean']:.1%} ± {m['valid_std']:.1%} | {m['final_train_loss_mean']:.3f} "
            f"| {m['train_ms_per_batch']:.0f} | {verdict} |")
    first = part["rows"][0]
    lines += ["", (f"Errors over {first['valid_labelled']:,} (valid) and {first['test_labelled']:,} (test) labelled "
                   f"positions; std is the sample standard deviation over seeds. Curves: {figure_name(results, key)} (mean "
                   "over seeds, band from the best to the worst seed), each point the error on the first "
                   f"{first['run']['settings']['curve_batches']} test batches, a noisier estimate than the table's."), ""]
    return lines


def figure_name(results: str, key: str) -> str:
    return f"{results}_{key.replace(':', '-')}.png"


def plot_seeds(results: str, key: str, part: dict[str, object], out: Path) -> Path:
    """Test error vs training step, one line per model (mean over seeds) in a band from the best to the worst seed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("the figure needs matplotlib: pip install 'blockloop[plot]'") from exc
    fig, ax = plt.subplots(figsize=(6, 4))
    by_label: dict[str, list[list[dict[str, float]]]] = {}
    for r in part["rows"]:
        by_label.setdefault(r["label"], []).append(r["curve"])
    for label, curves in by_label.items():
        steps = [point["step"] for point in curves[0]]
        errors = [[point["test_error"] for point in curve] for curve in curves]
        per_step = list(zip(*errors))
        mean = [statistics.fmean(values) for values in per_step]
        (line,) = ax.plot(steps, mean, label=f"{label} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
        ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("training step")
    ax.set_ylabel("test error (labelled positions)")
    ax.set_ylim(0, 1)
    ax.set_title(key)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / figure_name(results, key)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def provenance(args: argparse.Namespace) -> dict[str, object]:
    return {
        **environment(args.device),
        "settings": {k: getattr(args, k) for k in ("steps", "batch_size", "seq_len", "lr", "seed", "eval_batches")}
        | ({"seeds": args.seeds, "curve_every": args.curve_every, "curve_batches": args.curve_batches}
           if args.part == "seeds" else {}),
    }


def markdown(record: dict[str, dict[str, object]], results: str, seeds: bool = False) -> str:
    cpu = results.endswith("_cpu")
    lines = [
        f"# Staircase family on state-tracking tasks{'' if seeds else ' and character-level LM'} "
        f"({'CPU, scaled down' if cpu else 'GPU'})",
        "",
    ]
    if cpu:
        lines += [
            ("Everything is shrunk to CPU scale: 2-layer d=64 cores (~0.11M parameters), shortened tasks "
             f"(`NAME:LENGTH`), a few hundred steps, {'several seeds per model' if seeds else 'one seed'} (the paper "
             "picks the best of several). Train times are medians per batch: compare them within one command's rows "
             "only (each line names its machine)."),
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
        if part["kind"] == "seeds":
            lines += seeds_markdown(key, part, results)
        elif part["kind"] == "task":
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
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["tasks", "seeds", "lm"])
    parser.add_argument("--task", default="random-walk:16", help="task for `tasks` and `seeds` (NAME or NAME:LENGTH)")
    parser.add_argument("--data", default="shakespeare", help="corpus for `lm` (byte tokenizer)")
    parser.add_argument("--models", nargs="+", help="LABEL=PRESET[,FIELD=VALUE...] entries (default: the part's list)")
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--seq-len", type=positive_int, default=128)
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="the (first) training seed")
    parser.add_argument("--seeds", type=positive_int, default=3, help="`seeds`: seeds per model, --seed, --seed + 1, ...")
    parser.add_argument("--curve-every", type=positive_int, default=100, help="`seeds`: steps between points of the test curve")
    parser.add_argument("--curve-batches", type=positive_int, default=8, help="`seeds`: test batches per curve point")
    parser.add_argument("--eval-batches", type=positive_int, default=20, help="evaluation batches per split")
    add_threads(parser, default=1)
    parser.add_argument("--device", type=device_name, default="cpu", help="cpu or cuda[:N]; results are written as *_cpu or *_gpu")
    parser.add_argument("--smoke", action="store_true",
                        help="a seconds-long check of the whole protocol: 4 steps, 2 seeds, 1-batch evaluations")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.seeds, args.curve_every, args.curve_batches, args.eval_batches = 4, 2, 2, 1, 1
        args.models = args.models or list(SMOKE_MODELS)
    check_models(args.models or {"tasks": TASK_MODELS, "lm": LM_MODELS, "seeds": SEED_MODELS}[args.part], args.seq_len)
    set_threads(args.threads)
    key = "lm" if args.part == "lm" else args.task
    # Results of CPU and GPU runs are kept apart: runs/... are not comparable across devices.
    results = (SEEDS_RESULTS if args.part == "seeds" else RESULTS) + ("_cpu" if args.device == "cpu" else "_gpu")
    out = output_dir(args)

    def row_key(row: dict[str, object]) -> tuple[object, ...]:
        return row["label"], row.get("seed")

    def save(part: dict[str, object]) -> None:
        """Merge ``part`` into the results after every model, so an interrupted run keeps what it measured.

        The JSON file is locked while it is read and rewritten: two runs (one per task) may share it."""
        with open(out / f"{results}.json", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            handle.seek(0)
            text = handle.read()
            record = json.loads(text) if text.strip() else {}
            if key in record:  # keep the rows of models (and seeds) this call did not run
                ran = {row_key(row) for row in part["rows"]}
                kept = [row for row in record[key]["rows"] if row_key(row) not in ran]
                part = part | {"rows": kept + part["rows"]}
            record[key] = part
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(record, indent=2) + "\n")
            handle.flush()
            md = out / f"{results}.md"
            # The hand-written reading of the numbers (a section starting at OBSERVATIONS) survives re-runs.
            kept_notes = md.read_text().partition(OBSERVATIONS)[2] if md.is_file() else ""
            md.write_text(markdown(record, results, seeds=args.part == "seeds") + ("\n" + OBSERVATIONS + kept_notes if kept_notes else ""))
            if args.part == "seeds":
                plot_seeds(results, key, record[key], out)

    run = {"tasks": run_tasks, "seeds": run_seeds, "lm": run_lm}[args.part]
    part = run(args, save)
    print(markdown({key: part}, results, seeds=args.part == "seeds"))


if __name__ == "__main__":
    run_script(main)
