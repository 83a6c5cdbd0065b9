"""Layer-wise LoRA for looped layers: one low-rank delta per loop on a shared linear weight.

A Relaxed Recursive Transformer (Bae et al. 2024, section 2.3, equation 3) computes ``h = W'x + s B_k A_k x``
at loop ``k``, where ``W'`` is the tied weight, ``A_k (r, in)`` and ``B_k (out, r)`` belong to loop ``k``
only, and ``s = alpha / r``. The per-loop matrices are stored stacked, ``A (loops, r, in)`` and
``B (loops, out, r)``, so that a batch whose rows sit at different loops (continuous depth-wise batching,
section 2.4) computes every row's delta in one gathered, batched matmul instead of one small matmul per
loop. Which loop the rows are at is read from a :class:`LoopIndex` the owning model sets before each pass.
A linear with a bias also gets one bias delta per loop, ``lora_bias (loops, out)``: a tied bias is as far from
each loop's original as the tied weight, and costs only a vector per loop to relax.

The paper relaxes every shared matrix: W^Q, W^K and W^V each get their own rank-r delta (appendix C names them
apart). blockloop multiplies the three in one fused product (:attr:`Linear.splits`), so a fused linear's LoRA
keeps one (A_m, B_m) per matrix m: the A_m are stacked along A's rank axis and B_m is B's rows of matrix m, the
first r_m columns. One rank-r delta over the fused weight would make q, k and v share r directions between them,
a worse fit at the same r than the paper's (r_m = min(r, in, out_m)).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from blockloop.nn.linear import Linear


class LoopIndex:
    """The loop the current pass runs: an ``int`` for the whole batch, or a ``(B,)`` tensor, one per row.

    Shared by every :class:`LoopLoRALinear` of a model (a plain object, so it holds no parameters and
    is not part of any state dict).
    """

    def __init__(self) -> None:
        self.value: int | Tensor = 0


class LoRAMatrix(NamedTuple):
    """Where one stacked matrix m of a :class:`LoopLoRALinear` lies: its ``rows`` of the weight (and of the
    output), its rows ``a`` of A's rank axis, its span ``b`` of a fused linear's flat B, and its rank r_m."""

    rows: slice
    a: slice
    b: slice
    rank: int


class LoopLoRALinear(Linear):
    """:class:`~blockloop.nn.linear.Linear` with one LoRA delta per loop and matrix; the base weight keeps its
    ``weight``/``bias`` names.

    ``lora_A``: ``(loops, r, in)`` and ``lora_B``: ``(loops, out, r)``; a fused linear of matrices m stacks its
    A_m along A's rank axis, ``(loops, sum of r_m, in)``, and lays its B_m ``(out_m, r_m)`` flat one after the
    other, ``(loops, sum of out_m r_m)`` (ranks differ where a matrix is narrower than r, GQA's W^K and W^V).
    With a bias, ``lora_bias``: ``(loops, out)``. ``reset_lora`` gives the standard zero init (A Gaussian, B
    and the bias delta zero), under which the layer equals its base.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, *, loops: int, rank: int, scaling: float, loop: LoopIndex,
        splits: tuple[int, ...] = (),
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, splits=splits)
        self.ranks = tuple(min(rank, in_features, out) for out in self.splits)
        self.rank, self.scaling, self.loop = max(self.ranks), scaling, loop
        self.lora_A = nn.Parameter(torch.empty(loops, sum(self.ranks), in_features))
        fused = len(self.splits) > 1
        b_shape = (sum(o * r for o, r in zip(self.splits, self.ranks)),) if fused else (out_features, self.rank)
        self.lora_B = nn.Parameter(torch.empty(loops, *b_shape))
        self.lora_bias = nn.Parameter(torch.empty(loops, out_features)) if bias else None
        self.reset_lora()

    def matrices(self) -> list[LoRAMatrix]:
        """The stacked matrices, in output order (one for a plain linear)."""
        found, out, a, b = [], 0, 0, 0
        for width, r in zip(self.splits, self.ranks):
            found.append(LoRAMatrix(slice(out, out + width), slice(a, a + r), slice(b, b + width * r), r))
            out, a, b = out + width, a + r, b + width * r
        return found

    def factor_b(self, b: Tensor, m: LoRAMatrix) -> Tensor:
        """B_m ``(..., out_m, r_m)`` as a view of ``b``, one loop's (or rows' gathered) ``lora_B``."""
        if len(self.splits) == 1:
            return b
        return b[..., m.b].unflatten(-1, (m.rows.stop - m.rows.start, m.rank))

    @torch.no_grad()
    def reset_lora(self, loops: slice | int = slice(None)) -> None:
        """Zero init of the given loops' modules: Gaussian A ~ N(0, 1/in) (each A x entry at the scale of x, the
        Gaussian A of appendix E), B = 0."""
        nn.init.normal_(self.lora_A[loops], std=1 / math.sqrt(self.in_features))
        nn.init.zeros_(self.lora_B[loops])
        if self.lora_bias is not None:
            nn.init.zeros_(self.lora_bias[loops])

    def delta(self, x: Tensor, loop: int | Tensor) -> Tensor:
        """``s B_k A_k x`` (+ the bias delta) for ``x (B, T, in)``, each stacked matrix by its own (A_m, B_m); with
        a ``(B,)`` tensor ``loop``, row b uses loop ``loop[b]`` (A and B gathered per row, batched matmuls)."""
        a, b = self.lora_A[loop], self.lora_B[loop]  # one loop's, or gathered per row with a leading (B,) axis
        low = x @ a.transpose(-1, -2)
        parts = [low[..., m.a] @ self.factor_b(b, m).transpose(-1, -2) for m in self.matrices()]
        out = (parts[0] if len(parts) == 1 else torch.cat(parts, -1)) * self.scaling
        if self.lora_bias is None:
            return out
        return out + (self.lora_bias[loop] if isinstance(loop, int) else self.lora_bias[loop][:, None])

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.delta(x, self.loop.value)

    def extra_repr(self) -> str:
        ranks = self.ranks[0] if len(set(self.ranks)) == 1 else self.ranks
        matrices = f", matrices={len(self.splits)}" if len(self.splits) > 1 else ""
        return f"{super().extra_repr()}, loops={self.lora_A.shape[0]}, rank={ranks}{matrices}, scaling={self.scaling:g}"


def add_loop_lora(module: nn.Module, *, loops: int, rank: int, scaling: float, loop: LoopIndex) -> list[LoopLoRALinear]:
    """Replace every :class:`~blockloop.nn.linear.Linear` inside ``module`` by a :class:`LoopLoRALinear` of the same
    shape and splits (fresh weights: call before the model initialises or loads them); returns the new layers. A
    matrix narrower than ``rank`` gets its own full rank, min(in, out): more could not add anything, and one narrow
    matrix (an attention narrower than the model, GQA's keys) must not cap the rank of the others."""
    added = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Linear:
                lora = LoopLoRALinear(
                    child.in_features, child.out_features, child.bias is not None,
                    loops=loops, rank=rank, scaling=scaling, loop=loop, splits=child.splits,
                )
                setattr(parent, name, lora)
                added.append(lora)
    return added


@torch.no_grad()
def split_fused_lora(tensors: dict[str, Tensor], model: nn.Module) -> list[str]:
    """Rewrite, in ``tensors`` (a state dict for ``model``), each fused linear's LoRA saved as ONE rank-r delta
    over its stacked matrices (blockloop before per-matrix LoRA: ``lora_B (loops, out, r)``) in
    :class:`LoopLoRALinear`'s per-matrix form, exactly: matrix m's delta B[rows m] A has rank <= r_m, so its
    truncated SVD at r_m is the delta itself. Returns the names of the layers rewritten; checkpoints written
    that way keep loading."""
    rewritten = []
    for name, module in model.named_modules():
        a_name, b_name = f"{name}.lora_A", f"{name}.lora_B"
        if not isinstance(module, LoopLoRALinear) or len(module.splits) == 1 or tensors.get(b_name, torch.empty(0)).ndim != 3:
            continue
        a, b = tensors[a_name], tensors[b_name]
        new_a, new_b = torch.zeros_like(module.lora_A, dtype=a.dtype), torch.zeros_like(module.lora_B, dtype=b.dtype)
        for loop in range(a.shape[0]):
            for m in module.matrices():
                u, s, vh = torch.linalg.svd(b[loop, m.rows].double() @ a[loop].double(), full_matrices=False)
                module.factor_b(new_b[loop], m)[:] = (u[:, : m.rank] * s[: m.rank]).to(b.dtype)
                new_a[loop, m.a] = vh[: m.rank].to(a.dtype)
        tensors[a_name], tensors[b_name] = new_a, new_b
        rewritten.append(name)
    return rewritten
