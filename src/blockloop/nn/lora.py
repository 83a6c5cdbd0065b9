"""Layer-wise LoRA for looped layers: one low-rank delta per loop on a shared linear weight.

A Relaxed Recursive Transformer (Bae et al. 2024, section 2.3, equation 3) computes ``h = W'x + s B_k A_k x``
at loop ``k``, where ``W'`` is the tied weight, ``A_k (r, in)`` and ``B_k (out, r)`` belong to loop ``k``
only, and ``s = alpha / r``. The per-loop matrices are stored stacked, ``A (loops, r, in)`` and
``B (loops, out, r)``, so that a batch whose rows sit at different loops (continuous depth-wise batching,
section 2.4) computes every row's delta in one gathered, batched matmul instead of one small matmul per
loop. Which loop the rows are at is read from a :class:`LoopIndex` the owning model sets before each pass.
A linear with a bias also gets one bias delta per loop, ``lora_bias (loops, out)``: a tied bias is as far from
each loop's original as the tied weight, and costs only a vector per loop to relax.
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
    """:class:`~blockloop.nn.linear.Linear` with one LoRA delta per loop; the base weight keeps its ``weight``/``bias`` names.

    ``lora_A``: ``(loops, r, in)``, ``lora_B``: ``(loops, out, r)``, and with a bias ``lora_bias``:
    ``(loops, out)``. ``reset_lora`` gives the standard zero init (A Gaussian, B and the bias delta zero),
    under which the layer equals its base.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, *, loops: int, rank: int, scaling: float, loop: LoopIndex
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.rank, self.scaling, self.loop = rank, scaling, loop
        self.lora_A = nn.Parameter(torch.empty(loops, rank, in_features))
        self.lora_B = nn.Parameter(torch.empty(loops, out_features, rank))
        self.lora_bias = nn.Parameter(torch.empty(loops, out_features)) if bias else None
        self.reset_lora()

    @torch.no_grad()
    def reset_lora(self, loops: slice | int = slice(None)) -> None:
        """Zero init of the given loops' modules: Gaussian A ~ N(0, 1/in) (each A x entry at the scale of x), B = 0."""
        nn.init.normal_(self.lora_A[loops], std=1 / math.sqrt(self.in_features))
        nn.init.zeros_(self.lora_B[loops])
        if self.lora_bias is not None:
            nn.init.zeros_(self.lora_bias[loops])

    def delta(self, x: Tensor, loop: int | Tensor) -> Tensor:
        """``s B_k A_k x`` (+ the bias delta) for ``x (B, T, in)``; with a ``(B,)`` tensor ``loop``, row b uses
        loop ``loop[b]``."""
        if isinstance(loop, int):
            out = (x @ self.lora_A[loop].transpose(0, 1)) @ self.lora_B[loop].transpose(0, 1) * self.scaling
            return out if self.lora_bias is None else out + self.lora_bias[loop]
        a, b = self.lora_A[loop], self.lora_B[loop]  # gathered per row: (B, r, in), (B, out, r)
        out = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2)) * self.scaling
        return out if self.lora_bias is None else out + self.lora_bias[loop][:, None]

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.delta(x, self.loop.value)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, loops={self.lora_A.shape[0]}, rank={self.rank}, scaling={self.scaling:g}"


def add_loop_lora(module: nn.Module, *, loops: int, rank: int, scaling: float, loop: LoopIndex) -> list[LoopLoRALinear]:
    """Replace every :class:`~blockloop.nn.linear.Linear` inside ``module`` by a :class:`LoopLoRALinear` of the same shape (fresh
    weights: call before the model initialises or loads them); returns the new layers. A linear narrower than
    ``rank`` gets its own full rank, min(in, out): more could not add anything, and one narrow linear (an attention
    narrower than the model) must not cap the rank of the others."""
    added = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Linear:
                lora = LoopLoRALinear(
                    child.in_features, child.out_features, child.bias is not None,
                    loops=loops, rank=min(rank, child.in_features, child.out_features), scaling=scaling, loop=loop,
                )
                setattr(parent, name, lora)
                added.append(lora)
    return added
