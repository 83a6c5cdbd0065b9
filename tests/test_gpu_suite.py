"""``benchmarks/gpu_suite.py --smoke``: the issue-12 GPU suite runs end to end on CPU with tiny presets and writes
every row of the issue's table, claiming none of the targets."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_ROWS = ["vanilla decode-heavy", "vanilla prefill-heavy", "block decode-heavy", "block prefill-heavy", "recursive",
              "recursive speculative", "double decoder", "training"]


def test_smoke_suite_writes_every_row_without_claiming_a_target(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--threads", "1",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (md,) = tmp_path.glob("gpu-*-cpu-smoke.md")
    record = json.loads(md.with_suffix(".json").read_text())
    assert record["smoke"] and record["torch"] and record["command"].endswith("--out-dir " + str(tmp_path))
    assert not [r for r in record["rows"] if "error" in r.get("measured", {})]  # a failing row is recorded, not raised
    rows = {r["row"]: r for r in record["rows"] if "target" in r}
    assert sorted(rows) == sorted(TABLE_ROWS)
    text = md.read_text()
    for name in TABLE_ROWS:
        (line,) = [line for line in text.splitlines() if line.startswith(f"| {name} |")]
        assert line.endswith("| smoke (CPU): no claim |")
    for name in TABLE_ROWS[:4]:
        m = rows[name]["measured"]
        assert m["tok_s"] > 0 and m["ttft_s"] > 0 and m["cache_bytes_per_sample"] > 0
    assert rows["vanilla decode-heavy"]["measured"]["hf_generate_tok_s"] > 0  # HF timed in the same run
    vanilla = rows["vanilla decode-heavy"]["measured"]
    assert vanilla["paged_tok_s"] > 0 and vanilla["paged_cache_bytes_per_sample"] > 0  # the paged KV cache beside it
    assert vanilla["paged_error"] is None
    assert vanilla["vs_whole_keys"] == vanilla["tok_s"] / vanilla["whole_keys_tok_s"]  # every slot read, beside it
    (every,) = [r["rows"] for r in record["rows"] if r["row"] == "decode-heavy throughput, every batch"]
    names = [r["name"] for r in every]
    assert names.index("tiny whole-keys") < names.index("tiny paged") < names.index("hf-generate") == len(names) - 2  # HF last: the slowest runs
    hf = every[names.index("hf-generate")]
    assert hf["ratio_vs_baseline"] == hf["tok_s"] / next(r["tok_s"] for r in every if r["name"] == "tiny"
                                                        and r["batch"] == hf["batch"])
    rec = rows["recursive"]["measured"]
    assert 0.0 <= rec["greedy_agreement_vs_no_exit"] <= 1.0 and 1.0 <= rec["mean_exit_loop"] <= 2.0
    assert all(loss is not None and math.isfinite(loss) for loss in rec["val_loss"].values())
    spec = rows["recursive speculative"]["measured"]
    assert spec["greedy_agreement_vs_no_exit"] == 1.0  # speculation keeps the full model's greedy output
    assert 0.0 <= spec["acceptance_rate"] <= 1.0 and spec["tokens_per_pass"] >= 1.0
    assert 0 < rows["double decoder"]["measured"]["kv_bytes_ratio"] < 1
    assert rows["training"]["measured"]["eager"]["tokens_per_s"] > 0
    # The early-exit-trained 2-loop model is made by recorded blockloop commands.
    commands = "\n".join(record["commands"])
    assert "blockloop convert --to recursive" in commands and "--early-exit weighted" in commands
    assert "$WORK" in commands and "/tmp" not in commands


def test_a_suite_stopped_at_the_device_time_limit_keeps_the_rows_it_finished(tmp_path):
    """A device call is killed at 10 minutes: the suite writes after every row, and a subset of the rows is named by
    them, so the calls a session splits the suite into do not overwrite each other."""
    suite = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--threads", "1",
                              "--rows", "decode-heavy,training", "--out-dir", str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        for line in suite.stdout:
            if line.startswith("[gpu_suite] decode-heavy done"):
                break
        suite.kill()  # as the device tool's limit does, before the training row
    finally:
        suite.wait(timeout=60)
    (path,) = tmp_path.glob("gpu-*-cpu-smoke-decode-heavy-training.json")
    record = json.loads(path.read_text())
    assert record["rows_done"] == ["decode-heavy"] and record["rows_asked"] == ["decode-heavy", "training"]
    assert {"vanilla decode-heavy", "block decode-heavy"} <= {r["row"] for r in record["rows"]}
    assert "**incomplete**: stopped before training" in path.with_suffix(".md").read_text()


def test_a_suite_stopped_inside_a_row_keeps_what_it_measured_and_skips_what_it_is_told(tmp_path):
    """A row (decode-heavy compiles a graph per key length and engine) may outlast the call: each measurement is
    written as it is taken, under ``partial``; ``--skip`` leaves out comparisons measured before, ``--tag`` names
    the files apart from another run of the same rows."""
    suite = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--threads", "1",
                              "--rows", "decode-heavy", "--skip", "hf,paged", "--key-buckets", "2", "--tag", "cut",
                              "--out-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             cwd=ROOT)
    try:
        seen = []
        for line in suite.stdout:
            if line.startswith("[gpu_suite] {"):
                seen.append(json.loads(line.removeprefix("[gpu_suite] ")))
                if len(seen) == 2:
                    break
        suite.kill()  # in the middle of the row
    finally:
        suite.wait(timeout=60)
    (path,) = tmp_path.glob("gpu-*-cpu-smoke-decode-heavy-cut.json")
    record = json.loads(path.read_text())
    assert record["rows_done"] == [] and record["partial"]["row"] == "decode-heavy"
    assert record["partial"]["measured"][:2] == seen and record["plan"]["skip"] == ["hf", "paged"]
    assert record["plan"]["key_buckets"] == 2
    assert "**stopped in decode-heavy**: its 2 measurements so far" in path.with_suffix(".md").read_text()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--threads", "1",
                           "--rows", "decode-heavy", "--skip", "hf,paged", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(next(tmp_path.glob("gpu-*-cpu-smoke-decode-heavy.json")).read_text())
    names = {r["name"] for r in record["rows"][-1]["rows"]}
    assert names == {"tiny", "tiny-block", "tiny whole-keys"} and record["partial"] is None  # no HF, no paged rows
    vanilla = record["rows"][0]["measured"]
    assert vanilla["hf_generate_not_run"] == "skipped (--skip hf)" and "vs_hf" not in vanilla


def test_a_training_variant_that_fails_keeps_the_others_numbers(monkeypatch, capsys):
    """The compiled variant runs second: a compile that fails on the GPU used to lose the eager number measured
    before it (and the call's minutes)."""
    import dataclasses
    import importlib.util

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as the script runs: its neighbours importable
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    suite_module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_suite", suite_module)  # its dataclasses look their module up
    spec.loader.exec_module(suite_module)

    def run_variant(args, compiled, out):
        if compiled:
            raise RuntimeError("inductor could not compile")
        return {"variant": "eager", "tokens_per_s": 1000.0, "mfu": 0.25}

    monkeypatch.setattr(suite_module, "run_variant", run_variant)
    plan = dataclasses.replace(suite_module.SMOKE, train_variants=("eager", "compiled"))
    (row,) = suite_module.training_rows(suite_module.Suite(plan, torch.device("cpu"), torch.float32, 1.0, Path("."), []))
    assert row["measured"]["eager"]["tokens_per_s"] == 1000.0 and not row["met"]
    assert suite_module.summary(row) == ("eager 1,000 tok/s, MFU 25.0%; compiled failed: RuntimeError: inductor could "
                                         "not compile")
    assert capsys.readouterr().out.count("[gpu_suite] {\"row\": \"training\"") == 2  # each shown as it ended


def test_a_row_that_fails_keeps_what_it_measured_before(monkeypatch, tmp_path):
    """A row's last comparison failing (HF generate() out of memory at its batch) used to leave only the error: the
    engine rows measured before it went with the partial record."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    suite_module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_suite", suite_module)
    spec.loader.exec_module(suite_module)

    def double_decoder_rows(suite):
        suite.show({"name": "measured first", "tok_s": 1.0})
        raise RuntimeError("out of memory at the last comparison")

    monkeypatch.setattr(suite_module, "double_decoder_rows", double_decoder_rows)
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", "--smoke", "--rows", "double-decoder", "--out-dir", str(tmp_path)])
    suite_module.main()
    record = json.loads(next(tmp_path.glob("gpu-*-cpu-smoke-double-decoder.json")).read_text())
    (row,) = record["rows"]
    assert row["measured"]["error"] == "RuntimeError: out of memory at the last comparison"
    assert row["measured"]["measurements"] == [{"name": "measured first", "tok_s": 1.0}] and record["partial"] is None
