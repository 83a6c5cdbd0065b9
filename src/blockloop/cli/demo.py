"""``blockloop demo``: five families trained briefly on Shakespeare and compared (:mod:`blockloop.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from blockloop.cli.common import add_device, add_no_progress, add_threads, nonempty, positive_int, set_threads

HELP = ("train five model families (vanilla, block, double decoder, recursive, staircase) briefly on Shakespeare "
        "and compare them (CPU-sized: minutes; --device auto uses a GPU where there is one)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=nonempty, default="runs/demo", help="where the demo writes its runs (default: runs/demo)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps per model (default: the demo's own)")
    add_device(p)
    add_threads(p)
    add_no_progress(p)


def run(args: argparse.Namespace) -> int:
    from blockloop.demo import run_demo
    from blockloop.device import resolve_device

    set_threads(args.threads)
    run_demo(Path(args.out), steps=args.steps, device=resolve_device(args.device))
    return 0
