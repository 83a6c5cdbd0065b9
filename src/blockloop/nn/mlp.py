"""Feed-forward layers: the plain GELU MLP (Pythia: exact erf; GPT-2: tanh approximation) and the gated
SwiGLU/GeGLU ones (Llama/Gemma)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from blockloop.nn.linear import Linear


class MLP(nn.Module):
    """down(act(fc(x))), the 4x-wide MLP of GPT-2 and Pythia: exact erf GELU as Pythia uses, or with
    ``approximate="tanh"`` GPT-2's ``gelu_new``."""

    def __init__(self, d_model: int, d_ff: int, bias: bool, approximate: str = "none") -> None:
        super().__init__()
        self.fc = Linear(d_model, d_ff, bias=bias)
        self.proj = Linear(d_ff, d_model, bias=bias)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with SiLU, GeGLU with tanh-GELU (Shazeer 2020)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool, activation: str) -> None:
        super().__init__()
        self.gate = Linear(d_model, d_ff, bias=bias)
        self.up = Linear(d_model, d_ff, bias=bias)
        self.proj = Linear(d_ff, d_model, bias=bias)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate(x)
        gate = F.silu(gate) if self.activation == "swiglu" else F.gelu(gate, approximate="tanh")
        return self.proj(gate * self.up(x))


def build_mlp(kind: str, d_model: int, d_ff: int, bias: bool) -> nn.Module:
    if kind == "gelu":
        return MLP(d_model, d_ff, bias)
    if kind == "gelu_tanh":
        return MLP(d_model, d_ff, bias, approximate="tanh")
    if kind in ("swiglu", "geglu"):
        return GatedMLP(d_model, d_ff, bias, kind)
    raise ValueError(f"unknown mlp {kind!r}")
