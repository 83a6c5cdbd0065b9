"""``blockloop presets``: the named presets with their parameter counts."""

from __future__ import annotations

import argparse

from blockloop.cli.common import human, print_table

HELP = "list the named model presets with parameter counts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``presets`` takes no options."""


def run(args: argparse.Namespace) -> int:
    from blockloop.bench.reports import preset_sizes

    rows = [("preset", "family", "shape", "non-emb params", "total params", "description")]
    rows += [(s.name, s.family, s.shape, human(s.non_embedding), human(s.total), s.description) for s in preset_sizes()]
    print_table(rows)
    return 0
