"""``benchmarks/decode_profile.py --smoke``: the decode profiler a GPU session runs in one call works end to end on
CPU, every attention path it times computes the static decode step's attention, and the profiled engine steps, over
the static cache and the paged one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_profile_times_every_attention_path_and_the_engine_step(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # blockloop's Triton kernel runs too, in Triton's interpreter
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_profile.py"), "--smoke",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "decode_profile-cpu-smoke.json").read_text())
    sections = record["attention"]
    assert [a["kv_heads"] for a in sections] == [2, 1]  # tiny's own grouping, then the smoke's --grouped-kv-heads 1
    # One function, seven ways: SDPA's own grouping under the mask, eager and compiled, beside blockloop's five; then
    # the grouping alone: SDPA's own beside blockloop's.
    for a, paths, ways in zip(sections, ({"sdpa", "flex", "eager"}, {"sdpa"}), (7, 4)):
        timed = [r for r in a["rows"] if "live_gb_s" in r]
        assert not [r for r in a["rows"] if "error" in r]
        assert {r["path"].split(",")[0] for r in timed} == paths and all(r["ms"] > 0 for r in timed)
        masked = [r for r in timed if r["max_abs_error_vs_float64"] is not None]
        assert len(masked) == ways and max(r["max_abs_error_vs_float64"] for r in masked) < 1e-5
        assert sum("enable_gqa" in r["path"] for r in masked) == 2
        assert all(r["all_slots_gb_s"] >= r["live_gb_s"] > 0 for r in timed)  # live keys are a part of every slot
    # Part 4: FlashAttention's variable-length reads need CUDA (on CPU each is a row saying why); the engine's paged
    # read through FlexAttention, over pages scattered in the pool, computes the same attention at each page size,
    # and so does blockloop's Triton kernel.
    live = record["live_reads"]["rows"]
    flash, flex = ([r for r in live if r["path"].startswith(kind)] for kind in ("flash", "flex"))
    assert len(flash) == 3 and all("CPU" in r["error"] for r in flash)
    assert [r["path"].split()[2] for r in flex] == ["16-token", "32-token"]
    assert all(r["max_abs_error_vs_float64"] < 1e-5 and r["all_slots_gb_s"] >= r["live_gb_s"] > 0 for r in flex)
    # blockloop's Triton kernel over the same pool and page table (one key tile on CPU)
    kernel = [r for r in live if r["path"].startswith("triton")]
    assert [r["path"].split()[2] for r in kernel] == ["16-token", "32-token"]
    if importlib.util.find_spec("triton"):
        assert all(r["max_abs_error_vs_float64"] < 1e-5 for r in kernel), kernel
    else:
        assert all("triton" in r["error"] for r in kernel), kernel
    assert [(step["preset"], step["cache"]) for step in record["steps"]] == [
        ("tiny", "static"), ("tiny", "paged"), ("tiny-block", "static")]  # the Block Transformer's step too
    for step in record["steps"]:
        assert "error" not in step, step.get("error")
        assert step["steps"] == 4 and step["wall_ms_per_step"] > 0 and step["busy_ms_per_step"] > 0
        assert step["host_ms_per_step"] > 0 and "aten::" in step["table"] and "aten::" in step["host_table"]
    report = (tmp_path / "decode_profile-cpu-smoke.md").read_text()
    assert "| sdpa, dense (B,1,1,S) mask" in report and "decode step, `tiny`, paged cache" in report
    assert "decode step, `tiny-block`, static cache" in report and "The host's time by operator" in report
    assert "2 key/value heads" in report and "1 key/value head\n" in report
    assert "## Reading live keys only (part 4)" in report and "| flex over 32-token pages" in report
