"""Normalisation layers: LayerNorm (GPT-2/Pythia) and RMSNorm (Llama; Gemma's ``rmsnorm1p`` variant scales by
1 + weight), chosen by name from a config; and :class:`LoopNorm`, one of them with a gain (and bias) per loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockloop.nn.lora import LoopIndex
from blockloop.nn.precision import at_least_fp32, cast


def rms_norm(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    """``x / rms(x) * scale`` in at least float32, so bf16 activations do not lose the mean square."""
    x32 = at_least_fp32(x)
    return cast(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale, x.dtype)


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
        return rms_norm(x, self.weight + self.offset if self.offset else self.weight, self.eps)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "rmsnorm1p":
        return RMSNorm(dim, eps, offset=1.0)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}")


class LoopNorm(nn.Module):
    """A norm of a looped layer with its own gain (and, for LayerNorm, bias) per loop: ``weight (loops, dim)``.

    A Relaxed Recursive Transformer ties a layer's norms across loops, and a tied gain sits where no LoRA
    can reach it: after the q/k projections (q/k norms), after the attention and MLP (sandwich norms), or
    scaling the input of every linear it feeds (pre-norms). One gain vector per loop, initialised from the
    layer each depth position replaces, makes the SVD init of equation 4 exact at full rank for every
    architecture, for a few thousand parameters per layer. The loop comes from the model's :class:`LoopIndex`
    (an ``int``, or a ``(B,)`` tensor giving each row its own loop, as LoRA does).
    """

    def __init__(self, norm: nn.Module, loops: int, loop: LoopIndex) -> None:
        super().__init__()
        self.loop, self.eps = loop, norm.eps
        self.offset = getattr(norm, "offset", 0.0)
        self.layer_norm = isinstance(norm, nn.LayerNorm)
        self.weight = nn.Parameter(norm.weight.detach().expand(loops, -1).clone())
        self.bias = nn.Parameter(norm.bias.detach().expand(loops, -1).clone()) if self.layer_norm else None

    def forward(self, x: Tensor) -> Tensor:
        loop = self.loop.value
        weight = self.weight[loop]
        bias = self.bias[loop] if self.bias is not None else None
        if isinstance(loop, Tensor):  # (B, dim) gathered per row, broadcast over the row's other dims
            view = (weight.shape[0],) + (1,) * (x.dim() - 2) + (weight.shape[-1],)
            weight, bias = weight.view(view), bias.view(view) if bias is not None else None
        if self.layer_norm:
            return F.layer_norm(x, x.shape[-1:], eps=self.eps) * weight + bias
        return rms_norm(x, weight + self.offset, self.eps)

    def extra_repr(self) -> str:
        return f"loops={self.weight.shape[0]}, dim={self.weight.shape[1]}, eps={self.eps}"


def add_loop_norms(module: nn.Module, *, loops: int, loop: LoopIndex) -> list[LoopNorm]:
    """Replace every norm inside ``module`` by a :class:`LoopNorm` whose loops all start at its gain."""
    added = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (RMSNorm, nn.LayerNorm)):
                norm = LoopNorm(child, loops, loop)
                setattr(parent, name, norm)
                added.append(norm)
    return added
