"""``blockloop tasks list|make``: the synthetic state-tracking tasks, listed or written to a directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from blockloop.cli.common import add_no_progress, print_table
from blockloop.errors import BlockloopError

HELP = "list or write the synthetic state-tracking tasks (algorithm-3, algorithm-5, random-walk)"
DESCRIPTION = "Seeded train/valid/test splits of labelled-position tasks, written as memory-mappable arrays."


def add_arguments(p: argparse.ArgumentParser) -> None:
    verbs = p.add_subparsers(dest="tasks_command", required=True, metavar="VERB")
    verbs.add_parser("list", help="the task names, default sizes and descriptions")
    m = verbs.add_parser("make", help="generate a task and write its splits to --out")
    m.add_argument("name", help="task name (see `blockloop tasks list`)")
    m.add_argument("--out", required=True, help="directory to create (must not exist, or be empty)")
    m.add_argument("--seed", type=int, default=0, help="seed of the three splits (default: 0)")
    m.add_argument("--sizes", help="TRAIN,VALID,TEST counts of programs or sequences (default: the task's own)")
    add_no_progress(m)


def run(args: argparse.Namespace) -> int:
    return {"list": list_tasks, "make": make_task}[args.tasks_command](args)


def list_tasks(args: argparse.Namespace) -> int:
    from blockloop.data.tasks import TASKS

    rows = [("task", "vocab", "default sizes", "description")]
    rows += [
        (t.name, str(t.vocab.vocab_size), "/".join(map(str, t.default_sizes)), t.description) for t in TASKS.values()
    ]
    print_table(rows)
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
