"""What every verb shares: printing tables and sizes, ``--set`` overrides, ``--device``, and the
argument types that check every number at the boundary.

A flag's value is refused by argparse (exit code 2, one line naming the flag, the value and what is allowed)
before any work starts: an ``int`` flag declared with :func:`positive_int` never reaches the library as 0, a
``float`` flag declared with :func:`number` is never NaN or infinite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from blockloop.choices import KEY_BUCKETS
from blockloop.errors import BlockloopError, utf8_problem

_T = TypeVar("_T")


# When the allocator refuses (the model, a batch or a cache did not fit): what each verb can ask for less of.
MEMORY_FIXES = {
    "train": "lower --batch-size (--grad-accum keeps the step's batch) or --seq-len, or train a smaller model",
    "eval": "lower --batch-size", "generate": "lower --num-samples or --max-new-tokens",
    "serve": "serve fewer --slots or shorter ones (--max-len)", "chat": "use a shorter --max-len",
    "bench": "bench smaller batches or fewer slots", "demo": "run it on a machine with more free memory",
}
OTHER_MEMORY_FIX = "use a smaller model, or a machine with more free memory"


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


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high] (either bound may be left out)."""
    allowed = _range("an integer", low, high, False, False)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def number(
    low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False,
    infinite: bool = False,
) -> Callable[[str], float]:
    """An argparse type: a finite number (``infinite`` also allows inf) between ``low`` and ``high``, each bound
    inclusive unless ``*_open``."""
    allowed = _range("a finite number" if not infinite else "a number", low, high, low_open, high_open)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and (value >= high if high_open else value > high)
        if math.isnan(value) or (math.isinf(value) and not infinite) or below or above:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def _range(kind: str, low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    def show(bound: float) -> str:  # whole bounds in full (2**32 - 1, not 4.29497e+09)
        return str(bound) if isinstance(bound, int) else f"{bound:g}"

    if low is not None and high is not None:
        return f"{kind} in {'(' if low_open else '['}{show(low)}, {show(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {show(low)}"
    if high is not None:
        return f"{kind} {'<' if high_open else '<='} {show(high)}"
    return kind


positive_int = integer(1)
nonnegative_int = integer(0)
sampling_seed = integer(-(2**63), 2**63 - 1)  # what a request's seed takes, over HTTP too
positive_float = number(0, low_open=True)
nonnegative_float = number(0)
fraction = number(0, 1)  # a share in [0, 1]


def refuse_flags(names: Sequence[str], mode: str, *, fix: str | None = None, or_else: str = "") -> NoReturn:
    """Refuse flags (argparse dest names) that ``mode`` would ignore, rather than run without them: the one
    message of every verb with modes. The fix is to leave them out (``or_else`` adds the other way), or ``fix``."""
    flags = ", ".join("--" + name.replace("_", "-") for name in names)
    one = len(names) == 1
    raise BlockloopError(f"{flags} {'does' if one else 'do'} not apply to {mode}; "
                         + (fix or f"leave {'it' if one else 'them'} out{or_else}"))


def nonempty(value: str) -> str:
    """An argparse type: a value (a name, a path, a key) that is not empty (``--out ""`` would be the current
    folder)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty; give a value")
    return value


def utf8_text(value: str) -> str:
    """An argparse type: text that is valid UTF-8 (the shell hands undecodable bytes over as lone surrogates)."""
    problem = utf8_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem}; pass UTF-8")
    return value


def text_file(value: str) -> str:
    """An argparse type: the UTF-8 text of the file ``value`` names, read at once (a missing file fails before the
    model loads)."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{value} is not UTF-8 text") from None
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {value}: {exc.strerror}") from None


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated distinct positive integers, such as batch sizes (a size given twice would
    be timed twice, and its second row taken for the first's baseline)."""
    values = _positive_ints(text)
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"repeats {','.join(map(str, repeated))}; give each value once, got {text!r}")
    return values


def _positive_ints(text: str) -> list[int]:
    """Comma-separated positive integers (an empty item is a typo, not a separator)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated integers such as 1,4,16, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"needs positive integers, got {text!r}")
    return values


def names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of ``choices``, so a misspelt name stops the run at once
    rather than when the run reaches it."""

    def parse(text: str) -> list[str]:
        items = text.split(",")
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}")
        return items

    parse.__name__ = "names"
    return parse


def or_none(parse: Callable[[str], list[_T]]) -> Callable[[str], list[_T]]:
    """An argparse type: a list read by ``parse``, or '' for the empty list (a flag that may name nothing)."""

    def parse_or_none(text: str) -> list[_T]:
        return parse(text) if text else []

    parse_or_none.__name__ = parse.__name__
    return parse_or_none


def int_range(text: str) -> tuple[int, int]:
    """An argparse type: ``MIN,MAX`` of positive integers with MIN <= MAX."""
    values = _positive_ints(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"takes MIN,MAX with MIN <= MAX, got {text!r}")
    return values[0], values[1]


def add_checkpoint(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--checkpoint`` of the commands that load one model to serve (generate, chat, serve)."""
    p.add_argument("--checkpoint", required=True, type=nonempty, help="run directory or checkpoint directory")


def add_sampling(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--temperature``, ``--top-k`` and ``--top-p``, a request's :class:`~blockloop.serve.requests.SamplingParams`."""
    p.add_argument("--temperature", type=nonnegative_float, default=0.8, help="0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=positive_int, help="sample only among the k most likely tokens")
    p.add_argument("--top-p", type=number(0, 1, low_open=True),
                   help="sample only from the smallest set with this total probability (of what --top-k keeps)")


def check_sampling(args: argparse.Namespace) -> None:
    """At ``--temperature 0`` (greedy) nothing is sampled, so ``--top-k``, ``--top-p`` and ``--seed`` would be
    ignored without a word: they are refused instead."""
    if args.temperature == 0:
        given = [name for name in ("top_k", "top_p", "seed") if getattr(args, name, None) is not None]
        if given:
            refuse_flags(given, "--temperature 0 (greedy: nothing is sampled)",
                         or_else=", or give a temperature above 0 to sample")


def add_looped_decoding(p: argparse.ArgumentParser) -> None:
    """The two decode modes of a looped model (RRT section 3), the same flags in ``generate``, ``chat`` and
    ``serve``: depth-wise batching with early exit (``--exit``), or self-speculative decoding (``--speculate``)."""
    g = p.add_argument_group("looped (recursive) models: early exit or self-speculative decoding")
    g.add_argument("--exit", metavar="RULE[:THRESHOLD]",
                   help="batch depth-wise and leave the loops early by this rule, e.g. max_prob:0.9 or entropy:2.0 "
                   "(none:0 batches depth-wise without early exits)")
    g.add_argument("--speculate", type=positive_int, metavar="K",
                   help="draft K tokens with the first loops, verify them with all loops in one pass: the same greedy "
                   "output (the same distribution when sampling), fewer full-depth passes")
    g.add_argument("--draft-loops", type=positive_int, help="loops that draft under --speculate (default: 1)")
    g.add_argument("--adaptive-k", action="store_true",
                   help="--speculate K is each request's most: lower it after rejections, raise it after full acceptance")


def looped_decoding(args: argparse.Namespace) -> dict[str, Any]:
    """``exit_rule`` and ``speculation`` (a runner's options; None where not asked) from
    :func:`add_looped_decoding`'s flags, refusing flags that shape a mode not chosen."""
    from blockloop.serve.runners import ExitRule, Speculation

    if args.speculate is None and (args.draft_loops is not None or args.adaptive_k):
        raise BlockloopError("--draft-loops and --adaptive-k shape speculation; add --speculate K or leave them out")
    if args.exit is not None and args.speculate is not None:
        raise BlockloopError("--exit and --speculate are two decode modes of a looped model; give one of them")
    return {"exit_rule": None if args.exit is None else ExitRule.parse(args.exit),
            "speculation": None if args.speculate is None else Speculation(args.speculate, args.draft_loops or 1,
                                                                           args.adaptive_k)}


def add_no_progress(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--no-progress``, read once by :func:`blockloop.cli.main` for every bar of the process."""
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars, plain log lines only (bars are also off when stderr is not a terminal)")


def add_no_pack(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--no-pack``, read once by :func:`blockloop.cli.main` (:func:`blockloop.nn.linear.set_packing`)."""
    p.add_argument("--no-pack", action="store_true",
                   help="on CPU, multiply by the weights as stored instead of oneDNN-packed copies: saves a second "
                        "copy of every linear weight, at about 1.5x the decode time")


def add_key_buckets(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: int | None = KEY_BUCKETS) -> None:
    """``--key-buckets``, the engine's ``key_buckets`` (:class:`blockloop.serve.engine.Engine`)."""
    p.add_argument("--key-buckets", type=nonnegative_int, default=default,
                   help=f"key lengths a decode step over every slot of a static cache may read, each about 1.4x the "
                        f"next (default: {KEY_BUCKETS}; 0: every slot of the cache each step); with --compile each "
                        "is one more compiled graph")


def add_device(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = "auto") -> None:
    """``--device``, read with :func:`blockloop.device.resolve_device` (``default=None``: a command that must tell a
    flag given as ``auto`` from one left out fills in ``auto`` itself)."""
    p.add_argument("--device", default=default, type=device, help="auto, cpu, cuda, cuda:N or mps (default: auto)")


def add_threads(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: int | None = None) -> None:
    """``--threads``, applied with :func:`set_threads`; a positive integer, so 0 or -1 is refused by argparse
    rather than ignored or left to torch's own error."""
    default_text = "torch's own; 1 is steadier on a shared box" if default is None else str(default)
    p.add_argument("--threads", type=positive_int, default=default, help=f"CPU threads for torch (default: {default_text})")


def set_threads(threads: int | None) -> None:
    """Apply ``--threads`` before any work starts (a thread started later, such as the server's engine thread,
    inherits it); ``None`` keeps torch's own choice."""
    if threads is not None:
        import torch

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or threads
        if threads > cpus:  # allowed (a benchmark may want it), but rarely meant: threads then wait on each other
            print(f"warning: --threads {threads} is more than the {cpus} CPUs this process may use; they will "
                  "share them, which is usually slower", file=sys.stderr)
        torch.set_num_threads(threads)


DEVICE_TYPES = ("auto", "cpu", "cuda", "mps")


def device(name: str) -> str:
    """An argparse type: a device name torch knows (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``); whether it is
    present is checked later, by :func:`blockloop.device.resolve_device`."""
    kind, sep, index = name.partition(":")
    if kind not in DEVICE_TYPES or (sep and (kind not in ("cuda", "mps") or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"must be one of auto, cpu, cuda, cuda:N, mps, got {name!r}")
    return name


def terminal_safe(text: str) -> str:
    """``text`` safe for a terminal: a control character other than a newline or tab (an escape sequence that
    clears the screen or moves the cursor, a carriage return over the line) is written as its escape, ``\\x1b``.
    A byte-level or barely trained model emits them; written as they are, they rewrite the terminal."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else c.encode("unicode_escape").decode()
                   for c in text)
