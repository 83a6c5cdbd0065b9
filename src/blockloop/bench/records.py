"""Recorded benchmark runs: where a benchmark writes, the environment it records, JSON lines, and the
throughput-vs-loss Pareto plot (Block Transformer Figure 2).

A result file is only worth keeping if it says what produced it, so every benchmark stamps its output
with :func:`environment` (read from the machine, never typed in) and writes under ``runs/bench/`` unless
asked to ``--record`` into ``benchmarks/results/``, the results kept in git.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from blockloop.errors import BlockloopError
from blockloop.signals import terminate_as_interrupt

if TYPE_CHECKING:
    import torch

RECORDED = Path("benchmarks/results")
RECORD_KINDS = ("throughput", "stream", "http_stream")  # the "kind" of every record bench --record writes
SCRATCH = Path("runs/bench")
# Variables that change what a benchmark measures, carried in front of the recorded command line.
_COMMAND_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


class _RenamedOut(argparse.Action):
    """``--out``, the scripts' output flag before ``--out-dir``/``--record``: refused by name. Without it argparse
    would read ``--out PATH`` (the form recorded commands quote) as an abbreviation of ``--out-dir`` and write into
    a new folder named after the old output file."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        parser.error(f"--out was replaced: give --out-dir DIR (a folder; the script names its files) or --record "
                     f"(into {RECORDED}/), not --out {values}")


def _directory(text: str) -> Path:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; --out-dir names a folder the results are written into")
    return path


def run_script(main: Callable[[], object]) -> None:
    """Run a benchmark script's ``main`` as the CLI runs a verb: a :class:`BlockloopError` (a bad flag value, a
    missing run, an output path it may not write) is one line on stderr and exit status 2, and Ctrl-C or SIGTERM
    one line and 130, not a traceback (the scripts write their results as they go)."""
    try:
        with terminate_as_interrupt():
            main()
    except BlockloopError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """The one way a benchmark script chooses where its results go (see :func:`output_dir`)."""
    group = parser.add_argument_group("output")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--out-dir", type=_directory, metavar="DIR",
                       help=f"write the results into DIR (default: {SCRATCH}/)")
    where.add_argument("--record", action="store_true",
                       help=f"write into {RECORDED}/, the recorded results kept in git (run from the repository root)")
    group.add_argument("--out", action=_RenamedOut, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def output_dir(args: argparse.Namespace) -> Path:
    """``--out-dir`` if given, ``benchmarks/results`` with ``--record``, else ``runs/bench`` (created)."""
    if args.out_dir is not None:
        out = args.out_dir
    elif args.record:
        if not RECORDED.is_dir():
            raise BlockloopError(f"--record writes into {RECORDED}/ of the repository, which is not under "
                                 f"{Path.cwd()}: run from the repository root or give --out-dir")
        out = RECORDED
    else:
        out = SCRATCH
    out.mkdir(parents=True, exist_ok=True)
    return out


def environment(device: str = "cpu", dtype: torch.dtype | None = None) -> dict[str, Any]:
    """What every result carries, read from the running machine: device (GPU name, else ``cpu (MODEL)``), logical
    CPUs, torch threads, torch and Python versions, UTC date, the command line, and ``dtype`` when given."""
    import torch

    env = {"device": torch.cuda.get_device_name(device) if device.startswith("cuda") else f"cpu ({cpu_name()})",
           "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": command_line()}
    if dtype is not None:
        env["dtype"] = str(dtype).removeprefix("torch.")
    return env


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one (Linux), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line() -> str:
    """The command as typed (interpreter included), paths under the working directory made relative."""
    cwd = Path.cwd()

    def shorten(arg: str) -> str:
        path = Path(arg)
        return str(path.relative_to(cwd)) if path.is_absolute() and path.is_relative_to(cwd) else arg

    env = [f"{name}={os.environ[name]}" for name in _COMMAND_ENV if name in os.environ]
    return " ".join(env + [shlex.join(shorten(a) for a in sys.orig_argv)])


def environment_line(env: dict[str, Any]) -> str:
    """One markdown line from an :func:`environment` dict (older records with fewer keys render what they have)."""
    device = env.get("device", "?")
    if env.get("cpus"):
        device += f", {env['cpus']} logical CPUs"
    if env.get("threads"):
        device += f", {env['threads']} torch threads"
    parts = [f"device: {device}", f"torch {env.get('torch', '?')}"]
    if "python" in env:
        parts.append(f"Python {env['python']}")
    if "dtype" in env:
        parts.append(env["dtype"])
    parts.append(str(env.get("date", "?")))
    return "; ".join(parts) + (f"; command: `{env['command']}`" if env.get("command") else "")


def strict_json(value: Any) -> Any:
    """``value`` with every float that is not finite made ``None``: JSON has no NaN or infinity, and other readers
    (``jq``, JavaScript, Go) refuse the ``NaN`` and ``Infinity`` Python writes for them. They stand for what was not
    measured (HF ``generate()`` exposes no first-token time) or has no bound (a stream whose requests all queue at
    once)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Add ``records`` to the JSON-lines file ``path`` as strict JSON. The file is rewritten aside and renamed into
    place, so a full disk or a killed run leaves the records already there whole, never a cut line; appends to one
    file from several processes take turns."""
    from blockloop.files import copy_into_place, folder_lock

    new = "".join(json.dumps(strict_json(record), allow_nan=False) + "\n" for record in records).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with folder_lock(path.parent):  # another bench appending to the same file waits, rather than losing lines
            old = path.read_bytes() if path.exists() else b""
            copy_into_place(io.BytesIO(old + (b"\n" if old and not old.endswith(b"\n") else b"") + new), path)
    except OSError as exc:
        raise BlockloopError(f"could not add the results to {path} ({exc.strerror or exc}); the file is as it was: "
                             "free some space or give --record another file") from None


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise BlockloopError(f"no benchmark records at {path}; run `blockloop bench --record {path}` first")
    if path.is_dir():
        raise BlockloopError(f"{path} is a directory; --record names a JSON-lines file")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as exc:
            raise BlockloopError(f"{path} line {number} is not a JSON record ({exc.msg}); fix or delete that line") from None
        if record is not None and not isinstance(record, dict):
            raise BlockloopError(f"{path} line {number} is not a JSON object; fix or delete that line")
        if record is not None and record.get("kind") not in RECORD_KINDS:  # e.g. a training run's metrics.jsonl
            raise BlockloopError(f"{path} line {number} is not a bench record (its kind is none of "
                                 f"{', '.join(RECORD_KINDS)}): the file is another log; give --record a file of its own")
        if record is not None:
            records.append(record)
    return records


def last_val_loss(run_dir: Path) -> float | None:
    """The last ``val_loss`` a training run logged (its metrics.jsonl, here or in a parent directory)."""
    from blockloop.train.checkpoint import read_metrics  # torch: only for a --checkpoint bench

    for directory in (run_dir, *run_dir.parents):
        metrics = directory / "metrics.jsonl"
        if metrics.exists():
            losses = [r["val_loss"] for r in read_metrics(metrics) if "val_loss" in r]
            return losses[-1] if losses else None
    return None


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (throughput, loss) not beaten by another with higher throughput and lower loss, by throughput."""
    front, best_loss = [], float("inf")
    for tput, loss in sorted(points, key=lambda p: (-p[0], p[1])):
        if loss < best_loss:
            front.append((tput, loss))
            best_loss = loss
    return sorted(front)


def plot_pareto(records: list[dict[str, Any]], out: Path) -> int:
    """Throughput (log x) vs validation loss, one marker per recorded run at its best batch, front joined.

    Returns how many points were drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BlockloopError("--plot needs matplotlib: pip install 'blockloop[plot]'") from exc
    formats = plt.figure().canvas.get_supported_filetypes()  # matplotlib writes FILE.png for a FILE without one
    plt.close("all")
    if out.suffix.lstrip(".").lower() not in formats or out.is_dir():
        raise BlockloopError(f"--plot {out} is not an image file name; end it in "
                             f"{', '.join('.' + f for f in ('png', 'pdf', 'svg') if f in formats)}")
    best: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("val_loss") is not None and r.get("kind") == "throughput":
            missing = sorted({"name", "prompt_len", "gen_len", "tok_s"} - set(r))
            if missing:
                raise BlockloopError(f"a recorded throughput run lacks {', '.join(missing)}; the --record file was edited")
            numbers = [field for field in ("tok_s", "val_loss")
                       if isinstance(r[field], bool) or not isinstance(r[field], int | float)]
            if numbers:
                raise BlockloopError(f"a recorded throughput run's {', '.join(numbers)} is not a number; the --record "
                                     "file was edited")
            key = f"{r['name']} {r['prompt_len']}/{r['gen_len']}"
            if key not in best or r["tok_s"] > best[key]["tok_s"]:
                best[key] = r
    if not best:
        raise BlockloopError("no recorded throughput runs with a validation loss; bench trained runs with --checkpoint")
    setups = sorted({f"{r.get('device')}, {r.get('dtype')}, {r.get('threads')} threads, prompt {r['prompt_len']} / "
                     f"generate {r['gen_len']}" for r in best.values()})
    if len(setups) > 1:  # one axis of speed: a faster machine, dtype or shorter run is not a faster model
        raise BlockloopError(f"the recorded runs were timed in different setups ({'; '.join(setups)}); plot the runs of "
                             "one setup (record the others in another file)")
    measures = sorted({r["val_loss_measure"] for r in best.values() if r.get("val_loss_measure")})
    if len(measures) > 1:  # one axis of loss: runs whose losses score other things (or other tokens) do not share it
        raise BlockloopError(f"the recorded runs' validation losses score different things ({'; '.join(measures)}); "
                             "plot runs of one objective and tokenizer (record the others in another file)")
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, r in best.items():
        ax.scatter(r["tok_s"], r["val_loss"], label=label)
    front = pareto_front([(r["tok_s"], r["val_loss"]) for r in best.values()])
    ax.plot(*zip(*front), "k--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("generated tokens / s (best batch)")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return len(best)
