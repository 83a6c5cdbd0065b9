"""The one device resolver: ``auto`` means CUDA when present, and asking for CUDA without it is a clear error;
and the dtype ``auto`` means on a device."""

from __future__ import annotations

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
