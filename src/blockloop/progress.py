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


class _Lines:
    """A file for tqdm that turns each redraw into one plain line (no carriage returns, no padding)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _LogBar(tqdm):
    """tqdm as plain lines: none before any work is done (a ``0/N`` line says nothing), none repeating the one
    before (the last update and the close would both write the end)."""

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if self.n == 0 or self.n == getattr(self, "_shown", None):
            return True
        self._shown = self.n
        return super().display(msg, pos)


def bar(*, disable: bool = False, log_every: float | None = None, **kwargs: Any) -> tqdm:
    """A tqdm bar that respects the switch and the terminal; ``disable`` adds the caller's own reason.

    Work that runs for many minutes without other output passes ``log_every``: where no bar is drawn (a log
    file, ``--no-progress``) it still writes a plain line at most that many seconds apart, and one at the end,
    so a log shows what is running and how far it got."""
    if not disable and log_every is not None and not shown():
        kwargs.update(file=_Lines(sys.stderr), mininterval=log_every, leave=True, ascii=True, dynamic_ncols=False,
                      bar_format="{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}, {rate_fmt}]")
        return _LogBar(**kwargs)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(disable=disable or not shown(), **kwargs)
