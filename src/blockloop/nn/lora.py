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


class LoopLoRALinear(Linear):
    """:class:`~blockloop.nn.linear.Linear` with one LoRA delta per loop and matrix; the base weight keeps its
    ``weight``/``bias`` names.

    ``lora_A``: ``(loops, sum of ranks, in)``, ``lora_B``: ``(loops, out, max rank)`` (a matrix of rank r_m uses
    its rows' first r_m columns; the others stay zero), and with a bias ``lora_bias``: ``(loops, out)``. A
    one-matrix linear is plain ``A (loops, r, in)``, ``B (loops, out, r)``. ``reset_lora`` gives the standard
    zero init (A Gaussian, B and the bias delta zero), under which the layer equals its base.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, *, loops: int, rank: int, scaling: float, loop: LoopIndex,
        splits: tuple[int, ...] = (),
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, splits=splits)
        self.ranks = tuple(min(rank, in_features, out) for out in self.splits)
        self.rank, self.scaling, self.loop = max(self.ranks), scaling, loop
        self.lora_A = nn.Parameter(torch.empty(loops, sum(self.ranks), in_features))
        self.lora_B = nn.Parameter(torch.empty(loops, out_features, self.rank))
        self.lora_bias = nn.Parameter(torch.empty(loops, out_features)) if bias else None
        self.reset_lora()

    def matrices(self) -> list[tuple[slice, slice, int]]:
        """Per stacked matrix m: its rows of the weight (and of B), its rows of A, and its rank r_m."""
        out = rank = 0
        found = []
        for width, r in zip(self.splits, self.ranks):
            found.append((slice(out, out + width), slice(rank, rank + r), r))
            out, rank = out + width, rank + r
        return found

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
        a ``(B,)`` tensor ``loop``, row b uses loop ``loop[b]`` (A and B gathered per row, one batched matmul)."""
        a, b = self.lora_A[loop], self.lora_B[loop]  # (R, in), (out, r) or per row (B, R, in), (B, out, r)
        low = x @ a.transpose(-1, -2)
        if len(self.splits) == 1:
            out = low @ b.transpose(-1, -2)
        else:
            out = torch.cat([low[..., ranks] @ b[..., rows, :r].transpose(-1, -2) for rows, ranks, r in self.matrices()], -1)
        out = out * self.scaling
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
    over its stacked matrices (blockloop before per-matrix LoRA) as :class:`LoopLoRALinear`'s per-matrix form,
    exactly: matrix m's delta B[rows m] A has rank <= r_m, so its truncated SVD at r_m is the delta itself.
    Returns the names of the layers rewritten; checkpoints written that way keep loading."""
    rewritten = []
    for name, module in model.named_modules():
        a_name, b_name = f"{name}.lora_A", f"{name}.lora_B"
        if not isinstance(module, LoopLoRALinear) or len(module.splits) == 1 or a_name not in tensors:
            continue
        a, b = tensors[a_name], tensors[b_name]
        if a.shape[1] == sum(module.ranks) or a.ndim != 3 or b.ndim != 3 or b.shape[2] != a.shape[1]:
            continue
        new_a = a.new_zeros(a.shape[0], sum(module.ranks), a.shape[2])
        new_b = b.new_zeros(b.shape[0], b.shape[1], module.rank)
        for loop in range(a.shape[0]):
            for rows, ranks, r in module.matrices():
                u, s, vh = torch.linalg.svd(b[loop, rows].double() @ a[loop].double(), full_matrices=False)
                new_b[loop, rows, :r] = (u[:, :r] * s[:r]).to(b.dtype)
                new_a[loop, ranks] = vh[:r].to(a.dtype)
        tensors[a_name], tensors[b_name] = new_a, new_b
        rewritten.append(name)
    return rewritten
