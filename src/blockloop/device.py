"""The one device resolver: ``auto`` means CUDA when present, and asking for CUDA without it is a clear error;
what the dtype ``auto`` means on a device; and the free-memory check a serving cache is allocated through."""

from __future__ import annotations

import errno
import math

import torch

from blockloop.errors import BlockloopError


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` or ``cpu``; any other name is returned after checking that it can be used."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(name)
    except (RuntimeError, TypeError):
        raise BlockloopError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BlockloopError(f"--device {name} requested but CUDA is not available; use --device cpu")
    if name.startswith("mps") and not torch.backends.mps.is_available():
        raise BlockloopError(f"--device {name} requested but this torch build or machine has no MPS; use --device cpu")
    return name


def auto_dtype(device: str | torch.device) -> torch.dtype:
    """What ``auto`` precision means on ``device`` (training's autocast, the benchmarks' weights): bfloat16 on
    CUDA, whose tensor cores want it, float32 elsewhere (CPU bfloat16 kernels are slower than float32 ones)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class OutOfMemory(BlockloopError, torch.OutOfMemoryError):
    """A buffer that would not fit the device's free memory, refused before it is allocated: ``what`` did not fit,
    ``fix`` is what to change. Also a ``torch.OutOfMemoryError``, so code that tries a size and backs off (the
    benchmarks' batch search) treats it as the allocator's own; a caller that knows a better fix (the flag of the
    verb it serves) gives ``what`` with its own."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what}; {fix}")
        self.what = what


def ran_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's refusal: CUDA's ``OutOfMemoryError``, Python's ``MemoryError``, an OS call
    refused memory (``ENOMEM``, e.g. under ``ulimit -v``), or the CPU allocator's plain ``RuntimeError``."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in ("can't allocate memory",
                                                                                "not enough memory"))


def free_memory(device: str | torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``: CUDA's free memory plus what torch's caching allocator
    holds unused; on CPU, Linux's ``MemAvailable``; None where it is not known (no check is made there)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


def zeros_that_fit(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device, fix: str) -> torch.Tensor:
    """``torch.zeros`` for a large serving buffer (a KV cache), refused with :class:`OutOfMemory` when it would take
    more than 80% of the memory left, and ``fix`` named. On CPU Linux overcommits memory, so an oversized cache is
    not refused by the allocator: zeroing it gets the process (or a neighbour) killed by the kernel."""
    needed = math.prod(shape) * dtype.itemsize
    free = free_memory(device)
    if free is not None and needed > 0.8 * free:
        raise OutOfMemory(f"a cache buffer of {needed / 2**30:.2f} GiB would not fit the {free / 2**30:.2f} GiB free "
                          f"on {torch.device(device)}", fix)
    return torch.zeros(shape, dtype=dtype, device=device)
