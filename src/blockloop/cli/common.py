"""What every verb shares: printing tables and sizes, ``--set`` overrides, integer lists, ``--device``."""

from __future__ import annotations

import argparse
import json

from blockloop.errors import BlockloopError


def human(n: int) -> str:
    """A parameter count as ``85.06M`` or ``12.3K``."""
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Left-aligned columns; ``rows[0]`` is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


def parse_overrides(items: list[str]) -> dict[str, object]:
    """``FIELD=VALUE`` pairs; values are read as JSON (numbers, true/false, null) or else as strings."""
    overrides: dict[str, object] = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise BlockloopError(f"--set expects FIELD=VALUE, got {item!r}")
        try:
            overrides[field] = json.loads(value)
        except json.JSONDecodeError:
            overrides[field] = value
    return overrides


def parse_ints(text: str, flag: str) -> list[int]:
    """Comma-separated positive integers given to ``flag``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise BlockloopError(f"{flag} takes comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise BlockloopError(f"{flag} needs positive integers, got {text!r}")
    return values


def add_no_progress(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--no-progress``, read once by :func:`blockloop.cli.main` for every bar of the process."""
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars, plain log lines only (bars are also off when stderr is not a terminal)")


def add_device(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--device``, read with :func:`blockloop.device.resolve_device`."""
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
