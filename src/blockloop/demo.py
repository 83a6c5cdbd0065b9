"""``make demo`` / ``blockloop demo``: five model families trained briefly on Shakespeare, side by side.

Each family is one :class:`DemoEntry`; the demo trains it on CPU-sized settings with the shared trainer,
then reports parameters, validation loss before and after, and generation speed through the same
generation code, and prints a sample. Adding a family to the comparison means adding one entry.
"""

from __future__ import annotations

import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from blockloop.errors import BlockloopError
from blockloop.serve.batching import padded_prompt_length
from blockloop.serve.generate import generate
from blockloop.train.checkpoint import checkpoint_root, latest_name, read_json, write_json_atomic
from blockloop.train.config import TrainConfig
from blockloop.train.run import RunSpec, prepare_run, sequences
from blockloop.train.trainer import Trainer

SAMPLE_PROMPT = "ROMEO:\n"
DEMO_MARK = "demo.json"  # in each run the demo wrote: the checkpoint it left, so a rerun replaces only that


@dataclass(frozen=True)
class DemoEntry:
    family: str
    preset: str
    steps: int
    lr: float
    batch_size: int = 16
    seq_len: int = 256


DEMO_ENTRIES: tuple[DemoEntry, ...] = (
    DemoEntry("vanilla decoder", "demo", steps=300, lr=3e-3),
    DemoEntry("block transformer", "demo-block", steps=300, lr=3e-3),
    # 3 context + 1 generation layers (0.89M non-embedding vs 0.85M); its loss is the native block-partition
    # objective, and each step costs more on CPU (the dense dual attention), hence fewer steps.
    DemoEntry("double decoder", "demo-double", steps=150, lr=3e-3),
    # 2 shared layers looped twice: the vanilla demo's depth and compute per step with half its layer weights.
    DemoEntry("recursive transformer", "demo-recursive", steps=300, lr=3e-3),
    # The demo's 4-layer core run as a Staircase (C=32, S=64: two passes per token, state carried across
    # segments by truncated BPTT): same parameters, about twice the compute per token, hence smaller batches
    # (the shared weights leave the unigram plateau later than the plain decoder: about 100 steps at this size).
    DemoEntry("staircase", "demo-staircase", steps=150, lr=2e-3, batch_size=8, seq_len=128),
)


@dataclass
class DemoResult:
    entry: DemoEntry
    parameters: int
    val_loss_before: float
    val_loss_after: float
    train_seconds: float
    generate_tokens_per_s: float
    sample: str
    run_dir: Path


def run_demo(out_dir: Path, *, steps: int | None = None, device: str = "cpu") -> list[DemoResult]:
    """Train and compare every entry; prints progress, a summary table and samples."""
    check_demo_folder(out_dir)
    results = []
    for entry in DEMO_ENTRIES:
        results.append(_run_entry(entry, out_dir / entry.preset, steps or entry.steps, device))
    _print_summary(results)
    return results


def check_demo_folder(out_dir: Path) -> None:
    """Refuse, before any training, an ``--out`` where a rerun would delete what the demo did not write: the demo's
    runs are disposable and replaced each time, but a folder of the same name holding other files, or a demo run
    trained on since (``train --resume``), is somebody's work."""
    if out_dir.exists() and not out_dir.is_dir():
        raise BlockloopError(f"{out_dir} is a file, not a folder; give the demo a folder (--out)")
    for entry in DEMO_ENTRIES:
        run_dir = out_dir / entry.preset
        if run_dir.exists() and not _left_by_the_demo(run_dir):
            raise BlockloopError(f"{run_dir} holds files the demo did not leave there (another run, files of yours, a "
                                 "demo run trained on since, or one from an older blockloop), which a demo run would "
                                 "replace; move or delete it, or give the demo another folder (--out)")


def _left_by_the_demo(run_dir: Path) -> bool:
    """Whether ``run_dir`` is empty or as a demo run left it: its mark, metrics and checkpoints only, the latest
    checkpoint the one the mark names (none: the demo was stopped before its run finished)."""
    if not run_dir.is_dir():
        return False
    names = {path.name for path in run_dir.iterdir()}
    if not names:
        return True
    if not names <= {DEMO_MARK, "metrics.jsonl", "checkpoints"} or DEMO_MARK not in names:
        return False
    try:
        left = read_json(run_dir / DEMO_MARK)["latest"]
        return left is None or latest_name(checkpoint_root(run_dir)) == left
    except (BlockloopError, OSError, KeyError, TypeError):
        return False


def _run_entry(entry: DemoEntry, run_dir: Path, steps: int, device: str) -> DemoResult:
    print(f"\n=== {entry.family} ({entry.preset}) on Shakespeare, {steps} steps on {device} ===")
    shutil.rmtree(run_dir, ignore_errors=True)  # a demo run (check_demo_folder): disposable, started clean every time
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / DEMO_MARK, {"preset": entry.preset, "latest": None})  # marked before a stop can come
    spec = RunSpec(preset=entry.preset, data="shakespeare", tokenizer="byte")
    run = prepare_run(spec, seed=0)
    config = TrainConfig(
        steps=steps, batch_size=entry.batch_size, seq_len=entry.seq_len, lr=entry.lr,
        # about six validations over a full demo, but not one per step of a short --steps run (8 batches each)
        warmup_steps=max(1, steps // 20), eval_interval=max(steps // 6, min(steps, 25)), eval_batches=8,
        log_interval=max(1, steps // 18), ckpt_interval=steps, device=device, seed=0,
    )
    train_seqs, val_seqs = sequences(run.splits, config.seq_len)
    trainer = Trainer(run.model, run.model_config, run.tokenizer, train_seqs, val_seqs, config, run_dir, run_info=spec.to_dict())
    before = trainer.validate()["val_loss"]
    print(f"validation loss before training: {before:.4f}")
    start = time.perf_counter()
    after = trainer.fit()["val_loss"]
    train_seconds = time.perf_counter() - start
    write_json_atomic(run_dir / DEMO_MARK, {"preset": entry.preset, "latest": latest_name(checkpoint_root(run_dir))})

    model = trainer.model.eval()
    prompt = run.tokenizer.encode(SAMPLE_PROMPT)
    start = time.perf_counter()
    outs = generate(model, [prompt] * 8, 128, temperature=0.8, seed=0)
    speed = sum(len(o) for o in outs) / (time.perf_counter() - start)
    sample_length = run.model_config.context_length - padded_prompt_length(model, [prompt])
    sample = run.tokenizer.decode(generate(model, [prompt], sample_length, temperature=0.8, top_k=40, seed=1)[0])
    return DemoResult(entry, model.num_parameters(), before, after, train_seconds, speed, sample, run_dir)


def _print_summary(results: list[DemoResult]) -> None:
    header = ("family", "preset", "params", "val loss before", "val loss after", "train s", "generate tok/s")
    rows = [header] + [
        (
            r.entry.family, r.entry.preset, f"{r.parameters / 1e6:.2f}M", f"{r.val_loss_before:.3f}",
            f"{r.val_loss_after:.3f}", f"{r.train_seconds:.0f}", f"{r.generate_tokens_per_s:.0f}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print("\n=== comparison (byte-level Shakespeare, validation loss in nats per predicted byte) ===")
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    for r in results:
        print(f"\n--- {r.entry.family} sample ---\n{SAMPLE_PROMPT}{r.sample}")
        print(f"--- checkpoint: {r.run_dir} (try: blockloop generate --checkpoint {shlex.quote(str(r.run_dir))} --prompt 'JULIET:') ---")
