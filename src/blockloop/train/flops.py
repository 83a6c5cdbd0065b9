"""Measured FLOPs (torch's counter) and model FLOPs utilisation (MFU).

The formulas are each family's (:mod:`blockloop.families`, shared pieces in :mod:`blockloop.families.costs`).
MFU divides achieved FLOP/s by the device's dense bf16 peak, known only for the GPUs listed here.
"""

from __future__ import annotations

import torch
from torch import nn

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets (half the "with sparsity" figure), matched
# against the device's name, most specific first: an H100 PCIe or NVL is not an SXM part, whose peak would read its
# MFU low. The SXM parts' names carry no form factor ("NVIDIA H100 80GB HBM3", "NVIDIA H200").
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H100", 989e12),
                   ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 125e12))


def measured_forward_flops(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """FLOPs of one forward on ``batch`` counted by torch's FlopCounterMode (matmuls and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**batch)
    return counter.get_total_flops()


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def mfu(flops_per_s: float, device: torch.device) -> float | None:
    """Fraction of the device's bf16 peak, or None where the peak is unknown (e.g. CPU)."""
    peak = peak_flops(device)
    return flops_per_s / peak if peak else None
