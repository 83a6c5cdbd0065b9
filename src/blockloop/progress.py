"""Progress bars: one switch for the whole process, and none where nobody watches them.

A bar redrawn into a log file is noise (hundreds of carriage-return frames), so bars are drawn only when
stderr is a terminal, and ``--no-progress`` (every long-running verb has it) turns them off there too. Long
work still says what it does in plain lines, which read the same on a terminal and in a log.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

_enabled = True


def set_enabled(enabled: bool) -> None:
    """Turn every later bar of this process on or off (``--no-progress``)."""
    global _enabled
    _enabled = enabled


def shown() -> bool:
    """Whether a bar made now would be drawn."""
    return _enabled and sys.stderr.isatty()


def bar(*, disable: bool = False, **kwargs: Any) -> tqdm:
    """A tqdm bar that respects the switch and the terminal; ``disable`` adds the caller's own reason."""
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(disable=disable or not shown(), **kwargs)
