"""Tiny trained runs and a uvicorn server on a free port in a background thread, for the server and chat tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from blockloop.cli import main

TRAIN = ["train", "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1", "--eval-interval", "2",
         "--eval-batches", "1", "--device", "cpu", "--no-progress"]


def tiny_run(root: Path, preset: str) -> Path:
    """A run of ``preset`` trained for two steps on byte-level Shakespeare (made once per folder)."""
    out = root / preset
    if not (out / "checkpoints" / "latest").is_file():
        assert main([*TRAIN, "--preset", preset, "--out", str(out)]) == 0
    return out


@contextmanager
def running(app) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 at a free port; yields the base URL and stops the server afterwards."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def metric(text: str, name: str) -> float:
    """One sample's value from a Prometheus text exposition (``name`` with its labels, as printed)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {name} in /metrics")
