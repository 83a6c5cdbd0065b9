"""Where low-precision activations must be upcast (softmax, norms, rotations, losses)."""

from __future__ import annotations

import torch
from torch import Tensor


def at_least_fp32(x: Tensor) -> Tensor:
    """``x`` in float32, or unchanged if it is already float32/float64 (float64 tests stay exact)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
