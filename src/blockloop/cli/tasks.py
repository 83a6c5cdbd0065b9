"""``blockloop tasks list|make|import``: the synthetic state-tracking tasks listed or written to a directory, or
your own labelled sequences (JSON lines) written as a task directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from blockloop.cli.common import add_no_progress, nonempty, nonnegative_int, number, print_table
from blockloop.errors import BlockloopError

HELP = "list or write the state-tracking tasks (algorithm-3, algorithm-5, random-walk), or import your own"
DESCRIPTION = "Seeded train/valid/test splits of labelled-position tasks, written as memory-mappable arrays."
share = number(0, 1, low_open=True, high_open=True)  # of an imported file's sequences: each split gets some


def add_arguments(p: argparse.ArgumentParser) -> None:
    verbs = p.add_subparsers(dest="tasks_command", required=True, metavar="VERB")
    listing = verbs.add_parser("list", help="the task names, default sizes and descriptions")
    m = verbs.add_parser("make", help="generate a task and write its splits to --out")
    m.add_argument("name", help="task name (see `blockloop tasks list`), or NAME:N for N statements per program / "
                   "actions per walk")
    m.add_argument("--out", required=True, type=nonempty, help="directory to create (must not exist, or be empty)")
    m.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the three splits (default: 0)")
    m.add_argument("--sizes", help="TRAIN,VALID,TEST counts of programs or sequences (default: the task's own)")
    add_no_progress(m)
    i = verbs.add_parser("import", help="write labelled sequences from a .jsonl file as a task directory",
                         description='One sequence per line: {"tokens": [...], "labels": [...]}, one label per token '
                         "(null where nothing is asked). The vocabulary is built from the data.")
    i.add_argument("data", help="JSON-lines file of sequences (the train split when --valid and --test are given)")
    i.add_argument("--out", required=True, type=nonempty, help="directory to create (must not exist, or be empty)")
    i.add_argument("--name", type=nonempty, help="the task's name, recorded by runs (default: the --out directory's name)")
    i.add_argument("--valid", help="a file of validation sequences (with --test; default: drawn from DATA)")
    i.add_argument("--test", help="a file of test sequences (with --valid)")
    i.add_argument("--seed", type=nonnegative_int, help="seed of the split drawn from DATA (default: 0)")
    i.add_argument("--valid-fraction", type=share, help="share of DATA's sequences for valid (default: 0.1)")
    i.add_argument("--test-fraction", type=share, help="share of DATA's sequences for test (default: 0.1)")
    i.add_argument("--vocab-from", metavar="TASK_DIR",
                   help="reuse an imported task's vocabulary (new evaluation data for a trained model)")
    for verb in (listing, m, i):  # --debug after any command, as every other verb takes it; unset, the parser's holds
        verb.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show the full traceback of any error (or BLOCKLOOP_DEBUG=1)")


def run(args: argparse.Namespace) -> int:
    return {"list": list_tasks, "make": make_task, "import": import_task}[args.tasks_command](args)


def list_tasks(args: argparse.Namespace) -> int:
    from blockloop.data.tasks import TASKS

    rows = [("task", "vocab", "default sizes", "description")]
    rows += [
        (t.name, str(t.vocab.vocab_size), "/".join(map(str, t.default_sizes)), t.description) for t in TASKS.values()
    ]
    print_table(rows)
    print("NAME:N is a task at another length: N statements per program or N actions per walk (e.g. algorithm-3:50, "
          "random-walk:100), for tasks make, train --task and eval --task")
    return 0


def make_task(args: argparse.Namespace) -> int:
    from blockloop.data.tasks import get_task, load_task, write_task

    get_task(args.name)  # an unknown name fails before the sizes are looked at
    sizes = None
    if args.sizes is not None:
        try:
            sizes = [int(part) for part in args.sizes.split(",")]
        except ValueError:
            raise BlockloopError(f"--sizes expects three counts TRAIN,VALID,TEST, got {args.sizes!r}") from None
    out = write_task(args.name, Path(args.out), seed=args.seed, sizes=sizes, show_progress=True)
    meta = load_task(out).meta
    counts = ", ".join(f"{split} {meta['sizes'][split]} ({meta['tokens'][split]} tokens)" for split in meta["sizes"])
    print(f"wrote {args.name} (seed {args.seed}) to {out}: {counts}")
    return 0


def import_task(args: argparse.Namespace) -> int:
    from blockloop.data.tasks import import_task, load_task

    out = import_task(
        args.data, Path(args.out), name=args.name, valid=args.valid, test=args.test, seed=args.seed,
        valid_fraction=args.valid_fraction, test_fraction=args.test_fraction, vocab_from=args.vocab_from,
    )
    meta = load_task(out).meta
    counts = ", ".join(f"{split} {meta['sizes'][split]} ({meta['tokens'][split]} tokens)" for split in meta["sizes"])
    longest = meta["details"]["longest_sequence"]
    print(f"imported task {meta['task']} ({len(meta['vocab'])} words) to {out}: {counts}; longest sequence "
          f"{longest} tokens with its END: train with --seq-len {longest} or more")
    return 0
