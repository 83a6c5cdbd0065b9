"""SIGTERM read as Ctrl-C, for the verbs that stop cleanly on one.

A scheduler's stop (SLURM's preemption, ``docker stop``, Kubernetes, torchrun passing its own stop on) is a
SIGTERM; by default it ends the process on the spot, with no word of what was kept. Read as KeyboardInterrupt,
it takes the path a Ctrl-C takes: training says which checkpoint is kept, a server drains and exits 0.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class Terminated(KeyboardInterrupt):
    """A SIGTERM read as Ctrl-C. Its own type because a chat takes a Ctrl-C as "stop this answer" and goes on,
    while a scheduler's stop must end the process."""


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (elsewhere: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise Terminated


@dataclass
class StopRequest:
    """Whether a Ctrl-C or SIGTERM asked the work to stop at its next safe point."""

    requested: bool = False


@contextmanager
def stop_at_safe_point(what: str, enabled: bool = True) -> Iterator[StopRequest]:
    """Within the block, the first Ctrl-C or SIGTERM only sets ``requested`` (and says so), for the work to stop
    where its state is whole (a training step's end, where a checkpoint can be written); a second one raises
    KeyboardInterrupt at once. Disabled, or outside the main thread, it changes nothing."""
    stop = StopRequest()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request(signum: int, frame: object) -> None:
        if stop.requested:
            raise KeyboardInterrupt
        stop.requested = True
        print(f"\nstopping after {what} (again to stop at once)", file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, request) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

