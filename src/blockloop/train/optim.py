"""AdamW with the usual parameter groups, and the learning-rate schedule.

Weight decay applies to matrices only: norms and biases never decay (decaying a gain towards zero is
not regularisation), and embeddings only when asked, since decaying rarely seen token rows erases them.
The schedule is a pure function of the step, so resuming needs nothing but the step number.

With muP width scaling (the double-decoder paper's protocol, section 4 and Table 1) hidden matrices
train at ``hidden_lr_scale`` = d0/d times the base rate while embeddings, the output projection, norms
and biases keep the base rate; each group carries its factor as ``lr_scale`` and the trainer multiplies
the scheduled rate by it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from blockloop.choices import SCHEDULES


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    decay_embeddings: bool = False,
    fused: bool = False,
    hidden_lr_scale: float = 1.0,
) -> torch.optim.AdamW:
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, readout = [], [], []
    for name, param in model.named_parameters():  # tied parameters are yielded once
        if not param.requires_grad:
            continue
        is_embedding = id(param) in embedding_ids
        if param.dim() < 2 or (is_embedding and not decay_embeddings):
            no_decay.append(param)
        elif hidden_lr_scale != 1.0 and (is_embedding or name.endswith("lm_head.weight")):
            readout.append(param)  # decayed, but at the base learning rate under muP
        else:
            decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr_scale": hidden_lr_scale},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
    ]
    if readout:
        groups.append({"params": readout, "weight_decay": weight_decay, "lr_scale": 1.0})
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)


def lr_at(step: int, *, lr: float, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Linear warm-up over ``warmup_steps``, then decay to ``lr * min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        factor = 0.5 * (1 + math.cos(math.pi * progress))
    elif schedule == "linear":
        factor = 1 - progress
    else:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * factor)
