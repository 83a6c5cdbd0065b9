"""Where low-precision activations must be upcast (softmax, norms, rotations, losses).

Both helpers decide in Python and return their input untouched when there is nothing to cast: a decode step
calls them a few hundred times, and even a no-op ``Tensor.to`` is a trip through the dispatcher.
"""

from __future__ import annotations

import torch
from torch import Tensor

_WIDE = (torch.float32, torch.float64)


def at_least_fp32(x: Tensor) -> Tensor:
    """``x`` in float32, or unchanged if it is already float32/float64 (float64 tests stay exact)."""
    return x if x.dtype in _WIDE else x.float()


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)``, without the call when ``x`` already has it."""
    return x if x.dtype == dtype else x.to(dtype)
