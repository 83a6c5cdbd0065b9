"""Rotary position embeddings (RoFormer), full or partial as in GPT-NeoX/Pythia.

Angles are computed from explicit positions on every call instead of a precomputed table: it costs a
few element-wise ops, removes any maximum length, and lets each row of a batch sit at its own position
(left-padded prompts, rows at different decoding steps). The channel layout is the "rotate half" one
used by Hugging Face Llama and GPT-NeoX, so their checkpoints load without permuting weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from blockloop.nn.precision import at_least_fp32, cast


def rope_angles(positions: Tensor, rotary_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin in float32, shaped to broadcast over ``(B, H, T, D)`` queries and keys: ``(T, R)`` for
    positions ``(T,)`` shared by every row, ``(B, 1, T, R)`` for per-row positions ``(B, T)`` (the head axis
    is added here, once per pass, not by every layer's :func:`apply_rope`)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32) / rotary_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    if freqs.dim() == 3:
        freqs = freqs.unsqueeze(1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x (B, H, T, D)``; the rest pass through.

    ``cos``/``sin`` as :func:`rope_angles` gives them (they broadcast over heads).
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim == 0:
        return x
    partial = rotary_dim < x.shape[-1]
    x_rot = x[..., :rotary_dim] if partial else x
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    x_rot = cast(at_least_fp32(x_rot) * cos + at_least_fp32(rotated) * sin, x.dtype)
    return torch.cat((x_rot, x[..., rotary_dim:]), dim=-1) if partial else x_rot
