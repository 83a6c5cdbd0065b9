"""Normalisation layers: LayerNorm (GPT-2/Pythia) and RMSNorm (Llama; Gemma's ``rmsnorm1p`` variant scales by
1 + weight), chosen by name from a config."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from blockloop.nn.precision import at_least_fp32


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight), computed in float32 so bf16 activations do not lose the mean square.

    ``offset=1`` is Gemma's parameterisation (weights stored around 0, identity at weight = 0), kept as
    such so Gemma checkpoints load unchanged; the weight starts at the identity either way.
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: Tensor) -> Tensor:
        x32 = at_least_fp32(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight + self.offset if self.offset else self.weight
        return (normed * scale).to(x.dtype)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "rmsnorm1p":
        return RMSNorm(dim, eps, offset=1.0)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}")
