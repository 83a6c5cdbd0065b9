"""Recorded benchmark runs (JSON lines) and the throughput-vs-loss Pareto plot (Block Transformer Figure 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from blockloop.errors import BlockloopError


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise BlockloopError(f"no benchmark records at {path}; run `blockloop bench --record {path}` first")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_val_loss(run_dir: Path) -> float | None:
    """The last ``val_loss`` a training run logged (its metrics.jsonl, here or in a parent directory)."""
    for directory in (run_dir, *run_dir.parents):
        metrics = directory / "metrics.jsonl"
        if metrics.exists():
            losses = [r["val_loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "val_loss" in r]
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
    best: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("val_loss") is not None and r.get("kind") == "throughput":
            key = f"{r['name']} {r['prompt_len']}/{r['gen_len']}"
            if key not in best or r["tok_s"] > best[key]["tok_s"]:
                best[key] = r
    if not best:
        raise BlockloopError("no recorded throughput runs with a validation loss; bench trained runs with --checkpoint")
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
