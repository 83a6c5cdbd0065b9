"""From token windows to a model's forward arguments.

The loader yields ``(inputs, targets)`` windows of one token stream for every family. A family whose
training input is not the plain window (random-length padding into blocks, a sampled block partition,
span corruption, a prefix-LM breakpoint) defines ``collate_batch(inputs, targets, generator)`` on its
model class, returning the keyword arguments of its ``forward``; all others get :func:`lm_batch`. The
generator is seeded from (seed, step) by the trainer, so the random choices are reproducible and
resume exactly without being saved.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

Collate = Callable[[Tensor, Tensor, torch.Generator], dict[str, Tensor]]


def lm_batch(inputs: Tensor, targets: Tensor, generator: torch.Generator) -> dict[str, Tensor]:
    """Next-token prediction over the whole window."""
    return {"idx": inputs, "targets": targets}


def collate_for(model: nn.Module) -> Collate:
    return getattr(model, "collate_batch", lm_batch)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The CPU generator a collator draws from at ``step``: same (seed, step), same draws."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)
