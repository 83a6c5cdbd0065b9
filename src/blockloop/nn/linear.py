"""The linear layer every model uses, and oneDNN-packed weights for inference on CPU.

Why packing: decoding is almost all weight matmuls, and on CPU PyTorch's float32 ``F.linear`` goes to MKL's
sgemm, which on the AMD EPYC machines blockloop is measured on ran 1.9x (one row) to 2.4x (8 to 512 rows)
slower than oneDNN's kernels on the same weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the pair inductor's CPU freezing
uses). :func:`packed_linears` holds that reordered copy of every :class:`Linear` weight while inference runs
(generation, serving, evaluation) and drops it afterwards, so training and checkpoints only ever see the
plain ``weight``. The copy costs as much memory as the weights it packs, for as long as the context lasts;
where that memory matters more than the speed, :func:`set_packing` (the CLI's ``--no-pack``) turns packing off
for the process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_packing = True


def set_packing(enabled: bool) -> None:
    """Let every later :func:`packed_linears` of this process pack (the default) or not (``--no-pack``)."""
    global _packing
    _packing = enabled


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) that multiplies by its packed weight while one is held.

    The packed weight is used only where it computes what ``F.linear`` would: autograd off, no autocast, not
    under ``torch.compile`` (inductor picks its own kernels), and the weight unchanged since it was packed.
    """

    packed: Tensor | None = None
    packed_version: int = -1

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # first, so a traced forward never looks at the packed tensor
            return F.linear(x, self.weight, self.bias)
        packed = self.packed
        if (packed is not None and not torch.is_grad_enabled() and x.dtype == packed.dtype
                and self.weight._version == self.packed_version and not torch.is_autocast_enabled("cpu")):
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def packable(weight: Tensor) -> bool:
    """Whether oneDNN can pack ``weight`` here: a CPU float32 (or bfloat16, where the CPU has bf16 kernels)
    matrix, in a torch built with oneDNN."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@contextmanager
def packed_linears(model: nn.Module) -> Iterator[int]:
    """Pack every :class:`Linear` weight of ``model`` that :func:`packable` accepts for the context; yields how
    many were packed. Nested contexts leave the outer one's packing alone, so a caller that runs many
    generations can pack once around them all. Packs nothing after ``set_packing(False)``."""
    fresh = ([m for m in model.modules() if isinstance(m, Linear) and m.packed is None and packable(m.weight)]
             if _packing else [])
    with torch.no_grad():
        for m in fresh:
            m.packed, m.packed_version = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach()), m.weight._version
    try:
        yield len(fresh)
    finally:
        for m in fresh:
            m.packed, m.packed_version = None, -1
