"""Wall-clock timing of device work: CUDA events on GPU, ``perf_counter`` elsewhere."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Elapsed:
    seconds: float = 0.0


@contextmanager
def timed(device: torch.device) -> Iterator[Elapsed]:
    """``with timed(device) as t: ...`` then ``t.seconds``; on CUDA the end event is waited for, so
    queued kernels are counted."""
    elapsed = Elapsed()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield elapsed
        end.record()
        end.synchronize()
        elapsed.seconds = start.elapsed_time(end) / 1000.0
    else:
        t0 = time.perf_counter()
        yield elapsed
        elapsed.seconds = time.perf_counter() - t0


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Measured device memory bandwidth in bytes/s: a large tensor copy reads and writes ``nbytes``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        with timed(device) as t:
            dst.copy_(src)
        best = min(best, t.seconds)
    return 2 * src.numel() * 4 / best
