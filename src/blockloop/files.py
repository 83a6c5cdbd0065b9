"""Atomic file writes: readers see either the old file or the complete new one, never half of it.

Checkpoints, caches and metrics all go through here, so a run killed mid-write loses nothing that was
already on disk; :func:`run_lock` keeps a second process from writing the same run at the same time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from blockloop.errors import BlockloopError


def copy_into_place(src: IO[bytes], target: Path) -> None:
    """Stream ``src`` to ``target`` through a temporary file in the same folder, synced, then renamed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) atomically."""
    copy_into_place(io.BytesIO(text.encode("utf-8")), path)


LOCK_FILE = "lock"


@contextlib.contextmanager
def run_lock(directory: Path, enabled: bool = True) -> Iterator[None]:
    """Hold ``directory/lock`` while a process writes a run, so a second one (a repeated command, ``--resume``
    while the original still trains) refuses instead of interleaving logs and overwriting checkpoints.

    The lock file (pid and host) appears complete or not at all: it is written aside and hard-linked into
    place, which fails if a lock is there. A lock whose process is gone on this host is stale and replaced.
    The directory is created if needed, and removed again on release if the lock was all it ever held.
    """
    if not enabled:
        yield
        return
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise BlockloopError(f"{directory} is a file; name a directory for the run")
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / LOCK_FILE
    _acquire(lock)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        if created and not any(directory.iterdir()):
            directory.rmdir()


def _acquire(lock: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=lock.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
        for _ in range(2):
            try:
                os.link(tmp, lock)
                return
            except FileExistsError:
                holder = _holder(lock)
                if holder is not None:
                    raise BlockloopError(
                        f"{lock.parent} is in use by process {holder['pid']} on {holder['host']} (lock file {lock}); "
                        "wait for it to finish, or use another --out; if that process is gone, delete the lock file"
                    ) from None
                lock.unlink(missing_ok=True)  # stale: its process died without releasing it
        raise BlockloopError(f"could not take the lock {lock}: another process keeps replacing it; try again")
    finally:
        Path(tmp).unlink(missing_ok=True)


def _holder(lock: Path) -> dict[str, Any] | None:
    """Who holds ``lock``, or None when it is stale (its process is gone from this host, or it is unreadable)."""
    try:
        holder = json.loads(lock.read_text(encoding="utf-8"))
        pid, host = int(holder["pid"]), str(holder["host"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None  # never written whole: links are atomic, so this is not a live holder's file
    if host != socket.gethostname():
        return {"pid": pid, "host": host}  # cannot tell whether it is alive: assume it is
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return {"pid": pid, "host": host}
