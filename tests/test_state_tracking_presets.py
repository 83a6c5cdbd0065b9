"""The Algorithm-task presets (few passes, Table 7) and the multi-seed protocol of benchmarks/staircase_tasks.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from blockloop.data.tasks import TaskSequences, TaskTokenizer, generate_splits, get_task
from blockloop.families import build_model, from_name
from blockloop.families.staircase import CORES
from blockloop.train.run import padded_vocab
from blockloop.train.trainer import TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("name", "passes", "chunk", "step", "cache"),
    [
        ("staircase-algorithm-2pass", 2, 32, 64, 0),
        ("cached-staircase-algorithm-2pass", 1, 32, 64, 32),
        ("tiny-staircase-algorithm", 2, 16, 32, 0),
        ("tiny-cached-staircase-algorithm", 1, 16, 32, 16),
    ],
)
def test_algorithm_presets_have_the_paper_shape(name, passes, chunk, step, cache):
    config = from_name(name)
    assert (config.passes, config.chunk_size, config.step_size, config.cache_tokens) == (passes, chunk, step, cache)
    assert config.step_size // config.chunk_size == 2  # S/C = 2: two passes' worth of chunks per window
    if not name.startswith("tiny"):  # the paper's Algorithm core (Table 5): same parameters as every other model
        core = CORES["algorithm"]
        assert (config.n_layer, config.d_model, config.n_head, config.dropout) == (
            core["n_layer"], core["d_model"], core["n_head"], core["dropout"])
        assert build_model(config).num_parameters() == build_model(from_name("staircase-algorithm")).num_parameters()


@pytest.mark.parametrize("name", ["tiny-staircase-algorithm", "tiny-cached-staircase-algorithm"])
def test_tiny_algorithm_presets_run_and_their_loss_falls(tmp_path, name):
    task = get_task("algorithm-3:4")
    splits = generate_splits(task, seed=0, sizes=(300, 20, 1))
    end = task.vocab.id("END")
    train = TaskSequences(splits["train"], 32, end_id=end)
    config = from_name(name).replace(vocab_size=task.vocab.vocab_size, padded_vocab_size=padded_vocab(task.vocab.vocab_size))
    torch.manual_seed(0)
    model = build_model(config)
    inputs, labels = TaskSequences.to_batch([train[i] for i in range(3)])
    assert model(inputs)[0].shape == (3, 32, config.padded_vocab_size)
    cfg = TrainConfig(steps=40, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=4, eval_interval=1000,
                      log_interval=1, ckpt_interval=1000, device="cpu", progress=False)
    losses: list[float] = []
    Trainer(model, config, TaskTokenizer(task.name, task.vocab), train, None, cfg, tmp_path / "run").fit(
        on_step=lambda step, metrics: losses.append(metrics["loss"]))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)  # from ln(64 padded ids) towards the value distribution


def run_script(monkeypatch, argv: list[str]) -> None:
    """benchmarks/staircase_tasks.py's main() with ``argv``, in this process (no second torch import)."""
    spec = importlib.util.spec_from_file_location("staircase_tasks", ROOT / "benchmarks" / "staircase_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["staircase_tasks.py", *argv])
    module.main()


def test_seed_protocol_smoke_writes_table_curves_and_figure(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    argv = ["seeds", "--smoke", "--task", "random-walk:4", "--seq-len", "32", "--batch-size", "4", "--out-dir", str(out)]
    run_script(monkeypatch, argv)
    record = json.loads((out / "staircase_seeds_cpu.json").read_text())["random-walk:4"]
    runs = {(row["label"], row["seed"]) for row in record["rows"]}
    assert runs == {(label, seed) for label in ("transformer", "staircase") for seed in (0, 1)}
    for row in record["rows"]:
        assert [point["step"] for point in row["curve"]] == [2, 4]
        assert all(0.0 <= point["test_error"] <= 1.0 for point in row["curve"])
        assert row["run"]["settings"]["seeds"] == 2 and row["run"]["torch"] == torch.__version__
    table = (out / "staircase_seeds_cpu.md").read_text()
    assert "| staircase |" in table and " ± " in table and "staircase_seeds_cpu_random-walk-4.png" in table
    assert (out / "staircase_seeds_cpu_random-walk-4.png").read_bytes()[:4] == b"\x89PNG"
    # A later call for more seeds of one model keeps the other rows.
    run_script(monkeypatch, [*argv, "--models", "staircase=tiny-staircase-algorithm", "--seed", "2"])
    rows = json.loads((out / "staircase_seeds_cpu.json").read_text())["random-walk:4"]["rows"]
    assert sorted((row["label"], row["seed"]) for row in rows) == sorted(runs | {("staircase", 2), ("staircase", 3)})
