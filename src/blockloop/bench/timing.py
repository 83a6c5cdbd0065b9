"""Wall-clock timing of device work: CUDA events on GPU, ``perf_counter`` after a sync elsewhere."""

from __future__ import annotations

import time

import torch


class Timer:
    """``with timer: ...`` then ``timer.seconds``; waits for the device so queued kernels are counted."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> Timer:
        if self.device.type == "cuda":
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1000.0
        else:
            self.seconds = time.perf_counter() - self._t0


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Measured device memory bandwidth in bytes/s: a large tensor copy reads and writes ``nbytes``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        with Timer(device) as t:
            dst.copy_(src)
        best = min(best, t.seconds)
    return 2 * src.numel() * 4 / best
