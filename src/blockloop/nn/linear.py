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

Why measure: which kernel wins depends on the CPU. On an Intel Xeon, MKL's sgemm beat the packed kernel at one
row (1.15-1.3x) while losing at 8 rows (up to 2.6x, the LM head), so :func:`packed_faster` times both kernels
once per weight shape, dtype and thread count in the process, at one row (a lone decoding row) and at 8 (a
batch, a prefill), and a weight is packed only for the row counts where the packed kernel won (not at all if
it never did), and not for a caller whose decode steps multiply one row (``step_rows=1``: a one-slot engine) if
it won only at more rows: the prompt's prefill alone would not repay the reorder. The choice depends on the
timing, so on two machines (rarely, two runs) a float32 product may round differently, as it does between batch
sizes; ``--no-pack`` always takes ``F.linear``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_packing = True
TIMED_ROWS = (1, 8)  # a lone decoding row; a batch or a prefill (every count above one)
PROXY_OUTPUTS = 4096  # output features timed at most: the kernels' ratio decides, and a slice keeps it cheap
_choices: dict[tuple[int, int, torch.dtype, int], tuple[bool, bool]] = {}


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
    packed_for: tuple[bool, bool] = (False, False)  # use the packed kernel at one row, at more (packed_faster)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, splits: tuple[int, ...] = ()) -> None:
        """``splits``: the output widths of the matrices this weight stacks, when it is several fused into one
        product (an attention's W^Q, W^K, W^V); a layer-wise LoRA relaxes each of them on its own."""
        super().__init__(in_features, out_features, bias=bias)
        self.splits = splits or (out_features,)
        if sum(self.splits) != out_features:
            raise ValueError(f"splits {self.splits} do not add up to the {out_features} output features")

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # first, so a traced forward never looks at the packed tensor
            return F.linear(x, self.weight, self.bias)
        packed = self.packed
        if (packed is not None and not torch.is_grad_enabled() and x.dtype == packed.dtype
                and self.weight._version == self.packed_version and not torch.is_autocast_enabled("cpu")
                and self.packed_for[x.numel() > x.shape[-1]]):
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def packable(weight: Tensor) -> bool:
    """Whether oneDNN can pack ``weight`` here: a CPU float32 (or bfloat16, where the CPU has bf16 kernels)
    matrix, in a torch built with oneDNN."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed_faster(weight: Tensor) -> tuple[bool, bool]:
    """Whether oneDNN's packed kernel beats ``F.linear`` on a weight of this shape and dtype at one row and at
    :data:`TIMED_ROWS`' batch (see the module docstring): measured on its first :data:`PROXY_OUTPUTS` output
    features, once per shape, dtype and thread count in this process."""
    key = (*weight.shape, weight.dtype, torch.get_num_threads())
    if key not in _choices:
        with torch.no_grad():
            proxy = weight.detach()[:PROXY_OUTPUTS].contiguous()
            _choices[key] = tuple(packed_is_faster(proxy, rows) for rows in TIMED_ROWS)
    return _choices[key]


def packed_is_faster(weight: Tensor, rows: int, repeats: int = 7) -> bool:
    """Time both kernels on ``rows`` random rows, interleaved (other work on the machine slows both alike),
    best of ``repeats`` each (the first calls warm caches and create oneDNN's primitive)."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    kernels = (lambda: F.linear(x, weight), lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    best = [math.inf, math.inf]
    for _ in range(repeats):
        for i, kernel in enumerate(kernels):
            start = time.perf_counter()
            kernel()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[1] < best[0]


@contextmanager
def packed_linears(model: nn.Module, step_rows: int | None = None) -> Iterator[int]:
    """Pack every :class:`Linear` weight of ``model`` that :func:`packable` accepts, for the row counts where
    :func:`packed_faster` says packing pays, for the context; yields how many were packed. Nested contexts leave
    the outer one's packing alone, so a caller that runs many generations can pack once around them all. Packs
    nothing after ``set_packing(False)``.

    ``step_rows``: the most rows a decode step of the caller multiplies (None: any number). At one, a weight
    is packed only if the packed kernel wins at one row: the prompt's prefill then is the only many-row product,
    once per request, and gains less than reordering the weight costs (on the Xeon where MKL wins at one row,
    packing for the prefill alone cost a batch-1 ``generate`` 5%)."""
    candidates = ([m for m in model.modules() if isinstance(m, Linear) and m.packed is None and packable(m.weight)]
                  if _packing else [])
    fresh = []
    with torch.no_grad():
        for m in candidates:
            m.packed_for = packed_faster(m.weight)
            if m.packed_for[0] or (m.packed_for[1] and step_rows != 1):
                m.packed, m.packed_version = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach()), m.weight._version
                fresh.append(m)
    try:
        yield len(fresh)
    finally:
        for m in fresh:
            m.packed, m.packed_version = None, -1
