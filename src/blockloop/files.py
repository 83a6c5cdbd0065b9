"""Atomic file writes: readers see either the old file or the complete new one, never half of it.

Checkpoints, caches and metrics all go through here, so a run killed mid-write loses nothing that was
already on disk.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO


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
