"""SIGTERM read as Ctrl-C, for the verbs that stop cleanly on one.

A scheduler's stop (SLURM's preemption, ``docker stop``, Kubernetes, torchrun passing its own stop on) is a
SIGTERM; by default it ends the process on the spot, with no word of what was kept. Read as KeyboardInterrupt,
it takes the path a Ctrl-C takes: training says which checkpoint is kept, a server drains and exits 0.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread (elsewhere: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
