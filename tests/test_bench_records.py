"""Where benchmark scripts write and what environment they record: runs/bench/ unless --record, and machine
text read from the machine, never typed into a script."""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockloop.bench.records import add_output_arguments, environment, environment_line, output_dir
from blockloop.errors import BlockloopError

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_output_arguments(parser)
    return parser.parse_args(argv)


def test_output_dir_defaults_to_runs_bench_and_records_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    assert output_dir(parse()) == Path("runs/bench")
    assert (tmp_path / "runs" / "bench").is_dir()
    assert output_dir(parse("--record")) == Path("benchmarks/results")
    assert output_dir(parse("--out-dir", "elsewhere/x")) == Path("elsewhere/x")
    assert (tmp_path / "elsewhere" / "x").is_dir()


def test_out_dir_and_record_exclude_each_other_and_record_needs_the_repository(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse("--record", "--out-dir", "x")
    assert "not allowed with" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # no benchmarks/results/ here: --record must not invent one
    with pytest.raises(BlockloopError, match="repository root"):
        output_dir(parse("--record"))
    assert not (tmp_path / "benchmarks").exists()


def test_environment_describes_this_machine():
    env = environment("cpu", torch.bfloat16)
    assert set(env) == {"device", "cpus", "threads", "torch", "python", "date", "command", "dtype"}
    assert env["cpus"] == os.cpu_count() and env["threads"] == torch.get_num_threads()
    assert env["torch"] == torch.__version__ and env["python"] == platform.python_version()
    assert env["dtype"] == "bfloat16" and env["date"].endswith("+00:00")
    model = env["device"].removeprefix("cpu (").removesuffix(")")
    assert model and env["device"] == f"cpu ({model})"  # the CPU's model, not just the device kind
    if Path("/proc/cpuinfo").exists() and "model name" in Path("/proc/cpuinfo").read_text():
        assert model in Path("/proc/cpuinfo").read_text()
    # The interpreter as typed, after any thread or device settings the command line puts in front of it.
    words = [w for w in env["command"].split() if "=" not in w.split("/")[0]]
    assert words[0].endswith(Path(sys.orig_argv[0]).name)
    line = environment_line(env)
    assert f"{os.cpu_count()} logical CPUs" in line and torch.__version__ in line and env["command"] in line
    assert "dtype" not in environment("cpu")


def test_environment_line_renders_older_records():
    old = {"device": "cpu", "threads": 2, "torch": "2.13.0+cpu", "date": "2026-11-23", "command": "python x.py"}
    assert environment_line(old) == "device: cpu, 2 torch threads; torch 2.13.0+cpu; 2026-11-23; command: `python x.py`"


def test_a_script_offers_the_output_flags():
    result = subprocess.run([sys.executable, "benchmarks/staircase_speed.py", "--help"], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    assert "--record" in result.stdout and "--out-dir" in result.stdout and "runs/bench" in result.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_choose_output_one_way_and_describe_no_machine_by_hand(script):
    text = script.read_text()
    assert "add_output_arguments(" in text and "output_dir(" in text
    assert not re.search(r"default\s*=\s*[^,)]*benchmarks/results", text)
    for phrase in ("shared machine", "was shared", "shared with other jobs", "cores are shared", "no GPU was lent",
                   "PYTHONPATH=src python"):
        assert phrase not in text, f"{script.name}: {phrase!r}"
    # The usage lines in the docstring are the recording commands: they say --record.
    usage = [line for line in text.splitlines() if ".venv/bin/python benchmarks/" in line]
    assert usage and all("--record" in line for line in usage)
    # Numbers are checked at the boundary as the CLI's are (cli/common.py's types), and --threads is declared
    # one way, so a script never ignores 0, passes -1 on to torch, or fails later on an empty list of timings.
    assert not re.search(r"type=(int|float)\b", text) and 'add_argument("--device", default' not in text
    assert not re.search(r"int\(\w+\) for \w+ in args\.", text), "a list of numbers is parsed by its argparse type"
    assert "add_argument(\"--threads\"" not in text and "torch.set_num_threads(" not in text


@pytest.mark.parametrize("argv, message", [
    (["benchmarks/staircase_speed.py", "--threads", "0"], "--threads: must be an integer >= 1, got '0'"),
    (["benchmarks/staircase_speed.py", "--repeats", "0"], "--repeats: must be an integer >= 1, got '0'"),
    (["benchmarks/recursive_uptrain.py", "--lr", "nan"], "--lr: must be a finite number > 0, got 'nan'"),
    (["benchmarks/staircase_tasks.py", "--seed", "-1"], "--seed: must be an integer >= 0, got '-1'"),
    (["benchmarks/cpu_decode_vs_hf.py", "--batch-sizes", "1,x"], "--batch-sizes: takes comma-separated integers"),
    (["benchmarks/sync_window.py", "--tokens-range", "48,16"], "--tokens-range: takes MIN,MAX with MIN <= MAX"),
    (["benchmarks/recursive_uptrain.py", "--source", "smollm2", "--ranks", "0,4"], "--ranks: needs positive integers"),
    (["benchmarks/idle_slots.py", "--device", "gpu"], "--device: must be one of auto, cpu, cuda, cuda:N, mps"),
    (["benchmarks/recursive_uptrain.py", "--source", "smollm2", "--inits", "average,mean"], "--inits: unknown 'mean'; choose"),
    (["benchmarks/gpu_suite.py", "--rows", "decode-heavy,bogus"], "--rows: unknown 'bogus'; choose from decode-heavy,"),
    (["benchmarks/zero_shot_speed.py", "--checkpoint", "runs/none", "--tasks", "piqa,pica"], "unknown benchmark task(s) pica"),
])
def test_a_script_refuses_a_bad_number_in_one_line_before_any_work(argv, message):
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # no screenful of usage, as the verbs


def test_set_threads_applies_a_count_and_none_keeps_torchs_own():
    from blockloop.cli.common import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(None)
        assert torch.get_num_threads() == before
        set_threads(before + 1)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


def test_a_metrics_line_cut_short_by_a_kill_is_skipped_when_reading_the_last_val_loss(tmp_path):
    from blockloop.bench.records import last_val_loss

    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "val_loss": 3.5}\n{"step": 4, "loss": 3.1}\n{"step": 6, "val_lo')
    assert last_val_loss(tmp_path / "checkpoints" / "step_0000004") == 3.5


def test_a_throughput_timing_without_timed_runs_is_refused_before_any_work():
    from blockloop.bench.throughput import engine_throughput
    from blockloop.errors import BlockloopError
    from blockloop.families import build_model, from_name

    with pytest.raises(BlockloopError, match="repeats must be >= 1 timed runs, got 0"):
        engine_throughput(build_model(from_name("tiny")).eval(), "tiny", 1, 4, 4, repeats=0)


def test_the_renamed_out_flag_and_a_file_as_out_dir_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    # Recorded commands quote the old `--out PATH`; argparse would take it for an abbreviation of --out-dir.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        parse("--out", "benchmarks/results/staircase_speed_cpu.md")
    assert exc.value.code == 2 and "--out was replaced: give --out-dir DIR" in capsys.readouterr().err
    assert not (tmp_path / "benchmarks").exists()
    (tmp_path / "taken.json").write_text("{}")
    with pytest.raises(SystemExit):
        parse("--out-dir", "taken.json")
    assert "is a file; --out-dir names a folder" in capsys.readouterr().err


def test_a_benchmark_script_error_is_one_line_and_exit_status_2(capsys):
    """A script's BlockloopError (here --record outside the repository) ends it as the CLI's errors end a verb."""
    from blockloop.bench.records import run_script

    def main() -> None:
        raise BlockloopError("--record writes into benchmarks/results/ of the repository")

    with pytest.raises(SystemExit) as exit_:
        run_script(main)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: --record writes into benchmarks/results/ of the repository\n"
    run_script(lambda: None)  # a script that succeeds returns normally


def test_a_stopped_benchmark_script_is_one_line_and_exit_status_130(capsys):
    """Ctrl-C or SIGTERM in a benchmark script (staircase_tasks trains for many minutes) ended in a traceback and
    exit status 1."""
    import os
    import signal
    import time

    from blockloop.bench.records import run_script

    def main() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    with pytest.raises(SystemExit) as exit_:
        run_script(main)
    assert exit_.value.code == 130 and capsys.readouterr().err == "interrupted\n"


def test_a_record_file_that_cannot_be_written_is_refused_before_the_benchmark_runs(tmp_path, capsys):
    from blockloop.cli import EXIT_USER_ERROR, main

    (tmp_path / "file").write_text("not a folder")
    record = tmp_path / "file" / "runs.jsonl"
    code = main(["bench", "--presets", "tiny", "--prompt-len", "4", "--gen-len", "4", "--batch-sizes", "1",
                 "--repeats", "1", "--warmup", "0", "--device", "cpu", "--no-progress", "--record", str(record)])
    out, err = capsys.readouterr()
    assert code == EXIT_USER_ERROR and len(err.strip().splitlines()) == 1, err
    assert f"{record}; a file stands where a folder belongs" in err
    assert out == ""  # nothing was timed, so no result was thrown away


def test_a_record_file_that_holds_something_else_is_refused_before_the_benchmark_runs(tmp_path, capsys):
    """--record appends: a file that is not benchmark records (a README, say) is not appended to."""
    from blockloop.cli import EXIT_USER_ERROR, main

    record = tmp_path / "README.md"
    record.write_text("# notes\n")
    code = main(["bench", "--presets", "tiny", "--prompt-len", "4", "--gen-len", "4", "--batch-sizes", "1",
                 "--repeats", "1", "--warmup", "0", "--device", "cpu", "--no-progress", "--record", str(record)])
    out, err = capsys.readouterr()
    assert code == EXIT_USER_ERROR and "line 1 is not a JSON record" in err and out == ""
    assert record.read_text() == "# notes\n"
    metrics = tmp_path / "metrics.jsonl"  # JSON lines, but a training run's log
    metrics.write_text('{"step": 10, "loss": 3.2}\n')
    code = main(["bench", "--presets", "tiny", "--prompt-len", "4", "--gen-len", "4", "--batch-sizes", "1",
                 "--repeats", "1", "--warmup", "0", "--device", "cpu", "--no-progress", "--record", str(metrics)])
    out, err = capsys.readouterr()
    assert code == EXIT_USER_ERROR and "line 1 is not a bench record" in err and "a file of its own" in err and out == ""
    assert metrics.read_text() == '{"step": 10, "loss": 3.2}\n'


def test_names_takes_known_names_in_order_and_an_empty_list_only_when_allowed():
    from blockloop.cli.common import names, or_none

    parse = names(("eager", "compiled"))
    assert parse("compiled,eager") == ["compiled", "eager"]
    for bad, message in (("eager,", "unknown ''"), ("", "unknown ''"), ("eager,jit", "unknown 'jit'; choose from eager, compiled")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            parse(bad)
    assert or_none(names(("eager",)))("") == []


def test_models_that_share_a_folder_name_get_names_that_tell_them_apart(tmp_path):
    """Ratios are taken to the first model by name and plots key points by name: two runs' ``final`` folders, or a
    run named like a preset, must not share one (the baseline would be the last of them)."""
    from blockloop.bench.suite import add_ratios, checkpoint_name, load_models

    a, b = tmp_path / "expA" / "final", tmp_path / "expB" / "final"
    assert checkpoint_name(str(a), set()) == "final"
    assert checkpoint_name(str(b), {"final"}) == "expB/final"
    assert checkpoint_name(str(tmp_path / "tiny"), {"tiny"}) == f"{tmp_path.name}/tiny"
    every_suffix = {"/".join(a.resolve().parts[-k:]) for k in range(1, len(a.resolve().parts) + 1)}
    with pytest.raises(BlockloopError, match="given more than once"):
        checkpoint_name(str(a), every_suffix)
    step = tmp_path / "expC" / "checkpoints" / "step_0000400"  # one checkpoint of a run: named after the run,
    assert checkpoint_name(str(step), set()) == "expC"  # and two of one run by their steps
    assert checkpoint_name(str(step.parent / "step_0000800"), {"expC"}) == "expC/step_0000800"
    assert checkpoint_name(str(step.parent), set()) == "expC"
    with pytest.raises(BlockloopError, match="--presets names tiny more than once"):
        load_models("tiny,tiny", [], "cpu", torch.float32)
    rows = [{"name": name, "batch": 1, "tok_s": tok_s} for name, tok_s in (("final", 10.0), ("expB/final", 20.0))]
    add_ratios(rows, "final")
    assert [r["ratio_vs_baseline"] for r in rows] == [1.0, 2.0]


def test_records_are_strict_json_and_a_failed_write_leaves_the_file_whole(tmp_path, monkeypatch):
    """HF ``generate()`` rows carry no first-token time (NaN) and a stream with every request queued at once an
    unbounded rate (inf): Python writes those as ``NaN``/``Infinity``, which no strict JSON reader takes. Records
    were also appended in place, so a full disk left a cut line behind."""
    import json

    from blockloop.bench import records

    path = tmp_path / "runs.jsonl"
    path.write_text('{"kind": "throughput", "tok_s": 1.0}')  # an earlier record, its newline missing
    records.append_records(path, [{"kind": "throughput", "ttft_s": float("nan"), "rows": [float("inf"), 2.0],
                                   "nested": {"rate": float("-inf")}}])

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    lines = [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]
    assert lines == [{"kind": "throughput", "tok_s": 1.0},
                     {"kind": "throughput", "ttft_s": None, "rows": [None, 2.0], "nested": {"rate": None}}]
    before = path.read_bytes()

    def full_disk(src, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("blockloop.files.copy_into_place", full_disk)
    with pytest.raises(BlockloopError, match=rf"could not add the results to {re.escape(str(path))} \(No space left"):
        records.append_records(path, [{"kind": "throughput"}])
    assert path.read_bytes() == before


def test_a_batch_search_doubles_past_the_largest_size_given_in_any_order():
    """Doubling from the last size given (4,1 -> 2, 4) timed batch 4 twice; its second row then stood as the
    baseline of the first."""
    from blockloop.bench.throughput import search_batches
    from blockloop.cli.common import int_range

    assert search_batches(lambda batch: batch, [4, 1], search=True, max_batch=16) == [4, 1, 8, 16]
    assert search_batches(lambda batch: batch, [4, 1], search=False, max_batch=16) == [4, 1]
    stops: list[str] = []
    assert search_batches(lambda batch: batch, [4, 1], search=True, max_batch=16, on_stop=stops.append) == [4, 1, 8, 16]
    assert stops == ["the search stopped at batch 16: the next, 32, would pass --max-batch 16"]

    def cpu(batch: int) -> int:  # the CPU allocator's failure is a RuntimeError, which ended the whole bench
        if batch >= 8:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
        return batch

    stops.clear()
    assert search_batches(cpu, [1, 2], search=True, max_batch=4096, on_stop=stops.append) == [1, 2, 4]
    assert stops == ["out of memory at batch 8 (the CPU allocator); the batches before it are measured"]
    with pytest.raises(RuntimeError, match="shape mismatch"):  # any other error is a bug, not the end of a search
        search_batches(lambda batch: (_ for _ in ()).throw(RuntimeError("shape mismatch")), [1], search=True,
                       max_batch=4)
    assert int_range("16,16") == (16, 16)  # a range may be one value; a list of sizes may not repeat one


def test_an_interrupted_bench_keeps_the_rows_it_measured(tmp_path, monkeypatch, capsys):
    """Rows reached the table and the record only when every batch was done: Ctrl-C after minutes of timing kept
    nothing. Each row is now logged as measured and, on Ctrl-C, recorded (with its ratio) before exit 130."""
    from blockloop.bench import suite
    from blockloop.bench.records import read_records
    from blockloop.cli import main

    timed = suite.engine_throughput
    calls = []

    def interrupted_at_the_second(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return timed(*args, **kwargs)

    monkeypatch.setattr(suite, "engine_throughput", interrupted_at_the_second)
    record = tmp_path / "bench.jsonl"
    assert main(["bench", "--presets", "tiny", "--prompt-len", "8", "--gen-len", "4", "--batch-sizes", "1,2",
                 "--repeats", "1", "--device", "cpu", "--record", str(record)]) == 130
    err = capsys.readouterr().err
    assert "measured tiny at batch 1:" in err and f"the rows measured before the interrupt (1) are recorded in {record}" in err
    (row,) = read_records(record)
    assert (row["name"], row["batch"], row["ratio_vs_baseline"], row["device"].split()[0]) == ("tiny", 1, 1.0, "cpu")


def test_the_hf_baseline_without_transformers_is_refused_before_any_timing(monkeypatch, capsys):
    from blockloop.bench import hf_baseline, suite
    from blockloop.cli import main

    monkeypatch.setattr(hf_baseline, "hf_available", lambda: "transformers is not installed (pip install 'blockloop[hf]')")
    monkeypatch.setattr(suite, "engine_throughput", lambda *a, **k: pytest.fail("timed before the refusal"))
    assert main(["bench", "--presets", "tiny", "--hf", "--prompt-len", "8", "--gen-len", "4", "--device", "cpu"]) == 2
    assert "--hf times HF generate(), and transformers is not installed" in capsys.readouterr().err


def test_benches_appending_to_one_record_file_at_once_lose_no_lines(tmp_path):
    """Each append rewrites the file aside and renames it in: two at once each renamed their own copy over the
    other's (two processes of 200 appends left 203 lines). The folder is locked around the read and the rename."""
    path = tmp_path / "shared" / "records.jsonl"
    script = ("import sys; from pathlib import Path; from blockloop.bench.records import append_records\n"
              "for i in range(40): append_records(Path(sys.argv[1]), [{'kind': 'throughput', 'writer': sys.argv[2], 'i': i}])")
    writers = [subprocess.Popen([sys.executable, "-c", script, str(path), str(w)]) for w in range(4)]
    assert [w.wait(timeout=120) for w in writers] == [0] * 4
    from blockloop.bench.records import read_records

    written = read_records(path)
    assert sorted((r["writer"], r["i"]) for r in written) == [(str(w), i) for w in range(4) for i in range(40)]
