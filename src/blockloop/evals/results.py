"""Benchmark results as a table, a JSON record, and two records side by side (``blockloop eval --compare``)."""

from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path
from typing import Any

from blockloop.errors import BlockloopError
from blockloop.files import atomic_write_text

RESULTS_FILE = "benchmarks.json"


def _cell(value: float, stderr: float | None) -> str:
    """Percent ± standard error; none for a single question (stored as null; NaN in records of older versions)."""
    return f"{100 * value:.1f}" + ("" if stderr is None or math.isnan(stderr) else f" ± {100 * stderr:.1f}")


def _key(result: dict[str, Any], final_loop: int | None = None) -> tuple:
    """(task, metric, loop); a looped model's last exit is its output, so it lines up with a plain row."""
    loop = result.get("loop")
    return result["task"], result["metric"], None if loop == final_loop else loop


def table_rows(record: dict[str, Any]) -> list[tuple[str, ...]]:
    """Header + one row per (task, metric[, loop]): value ± stderr in percent, questions, shots, and the task's
    seconds on its first row (one pass scores all its metrics and loops)."""
    loops = any("loop" in r for r in record["results"])
    rows = [("task", "metric") + (("loop",) if loops else ()) + ("value (%)", "n", "shots", "seconds")]
    timed: set[str] = set()
    for r in record["results"]:
        seconds = "" if r["task"] in timed else f"{record['seconds'][r['task']]:.1f}"
        timed.add(r["task"])
        rows.append((r["task"], r["metric"]) + ((str(r["loop"]),) if loops else ())
                    + (_cell(r["value"], r["stderr"]), str(r["n"]), str(r["shots"]), seconds))
    return rows


def write_record(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1, allow_nan=False) + "\n")


def merge_earlier(record: dict[str, Any], path: Path) -> tuple[dict[str, Any], list[str]]:
    """``record`` with the results that an earlier run of the same checkpoint left at ``path`` for tasks this one did
    not score, and those tasks: scoring a checkpoint's tasks one command at a time (into its default
    ``benchmarks.json``) keeps them all, where writing the file afresh would drop all but the last command's. A
    task scored again is replaced whole. The record's date and command are this run's; ``earlier`` says, per kept
    task, the date and command of the run that scored it. Another checkpoint's results (or those of one retrained
    since, at the checkpoint's own default path) are replaced; anything else at ``path`` is refused before scoring
    (:func:`check_replaceable`)."""
    old = read_record(path) if path.is_file() else None
    if old is None or not _same_checkpoint(old.get("checkpoint"), record.get("checkpoint")):
        return record, []
    scored = {r["task"] for r in record["results"]}
    kept = [r for r in old["results"] if r["task"] not in scored]
    tasks = list(dict.fromkeys(r["task"] for r in kept))
    if not tasks:
        return record, []
    earlier_of = old.get("earlier") or {}
    earlier = {task: earlier_of.get(task) or {"date": old.get("date"), "command": old.get("command")} for task in tasks}
    seconds = {task: (old.get("seconds") or {}).get(task) for task in tasks}
    merged = {**record, "results": [*record["results"], *kept], "seconds": {**record["seconds"], **seconds},
              "earlier": earlier}
    return merged, tasks


def _same_checkpoint(a: str | None, b: str | None) -> bool:
    """Whether two records name one checkpoint however it was spelt (records name it absolutely; older ones as
    given, relative to the folder eval ran in)."""
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def results_path(out: str | None, checkpoint: str) -> Path:
    """Where eval writes its record: ``--out`` (``RESULTS_FILE`` inside it when it names a folder, as
    :func:`read_record` reads one), else the checkpoint's own ``RESULTS_FILE``."""
    if not out:
        return Path(checkpoint) / RESULTS_FILE
    return Path(out) / RESULTS_FILE if out.endswith(("/", os.sep)) or Path(out).is_dir() else Path(out)


def check_replaceable(path: Path, checkpoint: Path, given: bool) -> str | None:
    """Refuse, before any scoring, to write results over a file that holds something else (a user's notes, a
    dataset), or over another checkpoint's results at a path the user gave (``given``: ``--out``), which would be
    lost: only the same checkpoint's results are merged (:func:`merge_earlier`). Returns the checkpoint whose results
    the file holds where they will be replaced (the checkpoint's own default file, written by an earlier step of
    its run), else None."""
    if not path.is_file():
        return None
    try:
        earlier = read_record(path).get("checkpoint")
    except BlockloopError as exc:
        raise BlockloopError(f"{exc}; eval would overwrite it: give --out a new file, or remove this one") from None
    if _same_checkpoint(earlier, str(checkpoint)):
        return None
    if given:
        raise BlockloopError(f"{path} holds the results of another checkpoint, {earlier}, which eval would replace; "
                             "give --out a new file, or remove this one")
    return earlier


def read_record(path: str | Path) -> dict[str, Any]:
    """A record from its JSON file, or from ``benchmarks.json`` in a run directory, checked to hold results."""
    path = Path(path)
    file = path / RESULTS_FILE if path.is_dir() else path
    if not file.is_file():
        raise BlockloopError(f"no benchmark results at {file}; run blockloop eval --tasks ... --out {shlex.quote(str(file))} first")
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BlockloopError(f"{file} is not a benchmark results JSON file ({exc})") from None
    problem = _record_problem(record)
    if problem:
        raise BlockloopError(f"{file} is not a benchmark results file written by blockloop eval ({problem})")
    return record


def _record_problem(record: Any) -> str | None:
    """What a record lacks that the table and the comparison read (None: nothing)."""
    if not isinstance(record, dict) or not isinstance(record.get("results"), list):
        return "no list of results"
    if not isinstance(record.get("model", {}), dict | None):
        return "its model is not an object"
    def number(value: Any) -> bool:  # JSON true is no number
        return isinstance(value, int | float) and not isinstance(value, bool)

    for i, r in enumerate(record["results"]):
        if not (isinstance(r, dict) and isinstance(r.get("task"), str) and isinstance(r.get("metric"), str)
                and number(r.get("value")) and (r.get("stderr") is None or number(r["stderr"]))
                and (r.get("loop") is None or (isinstance(r["loop"], int) and not isinstance(r["loop"], bool)))):
            return f"result {i} is not an object with task, metric, value and stderr (and an integer loop, if any)"
    return None


def compare_rows(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> list[tuple[str, ...]]:
    """Header + one row per (task, metric[, loop]) in either record: A, B (percent ± stderr), B - A, and what
    differs between the two runs of it (shots, questions) when something does. A per-loop record's last loop is
    compared with the other's plain rows (both are the model's output)."""
    first, second = ({_key(r, (rec.get("model") or {}).get("loops")): r for r in rec["results"]} for rec in (a, b))
    keys = list(first) + [k for k in second if k not in first]
    rows = [("task", "metric", "loop", names[0], names[1], "B - A", "runs differ in")]
    for key in keys:
        x, y = first.get(key), second.get(key)
        cells = [_cell(r["value"], r["stderr"]) if r else "-" for r in (x, y)]
        diff = f"{100 * (y['value'] - x['value']):+.1f}" if x and y else "-"
        # where both say (a zero-shot run draws no examples, so it has no seed; older records count no cut questions)
        differ = [f"{field} {x[field]} vs {y[field]}" for field in ("shots", "n", "cut", "seed")
                  if x and y and x.get(field) is not None and y.get(field) is not None and x[field] != y[field]]
        rows.append((key[0], key[1], "" if key[2] is None else str(key[2]), *cells, diff, "; ".join(differ)))
    return rows
