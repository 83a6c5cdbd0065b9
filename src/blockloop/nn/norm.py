"""Normalisation layers: LayerNorm (GPT-2/Pythia) and RMSNorm (Llama), chosen by name from a config."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from blockloop.nn.precision import at_least_fp32


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 so bf16 activations do not lose the mean square."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = at_least_fp32(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}")
