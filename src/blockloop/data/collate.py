"""From token windows to a model's forward arguments.

The loader yields ``(inputs, targets)`` windows of one token stream for every family. A family whose
training input is not the plain window (random-length padding into blocks, a sampled block partition,
span corruption, a prefix-LM breakpoint) says so in its spec (``FamilySpec.make_batch``, see
:mod:`blockloop.families`), returning the keyword arguments of its ``forward``; all others get :func:`lm_batch`.
The generator is seeded from (seed, step) by the trainer, so the random choices are reproducible and
resume exactly without being saved.

``objective`` is ``"lm"`` (each family's native pretraining objective) or ``"prefix_lm"``, the
double-decoder paper's fine-tuning phase (section 4): one breakpoint per batch, drawn first from the
generator (so every family sees the same breakpoint at the same step), the prefix is context only and
just the suffix is scored. Every family scores the same targets, which makes their losses comparable.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from blockloop.errors import BlockloopError
from blockloop.nn.loss import IGNORE_INDEX

Collate = Callable[[Tensor, Tensor, torch.Generator], dict[str, Tensor]]


def sample_breakpoint(length: int, generator: torch.Generator) -> int:
    """The PrefixLM breakpoint: prefix = positions [0, b), scored suffix = [b, length), b uniform in 1..length-1."""
    if length < 2:
        raise BlockloopError(f"a PrefixLM window needs a prefix and a scored suffix, so at least 2 tokens; got {length} "
                             "(use a longer --seq-len)")
    return int(torch.randint(1, length, (1,), generator=generator))


def unscored_prefix(targets: Tensor, generator: torch.Generator) -> tuple[Tensor, int]:
    """Draw the PrefixLM breakpoint b and return the targets with positions [0, b) ignored (``IGNORE_INDEX``), and b."""
    breakpoint = sample_breakpoint(targets.shape[1], generator)
    targets = targets.clone()
    targets[:, :breakpoint] = IGNORE_INDEX
    return targets, breakpoint


def lm_batch(inputs: Tensor, targets: Tensor, generator: torch.Generator, objective: str = "lm") -> dict[str, Tensor]:
    """Next-token prediction over the whole window; under prefix_lm the prefix's targets are not scored.

    For a decoder-only model the prefix stays causal: it "merely does not provide additional loss
    information" (paper, section 4).
    """
    if objective == "prefix_lm":
        targets, _ = unscored_prefix(targets, generator)
    return {"idx": inputs, "targets": targets}


def step_generator(seed: int, step: int) -> torch.Generator:
    """The CPU generator a collator draws from at ``step``: same (seed, step), same draws."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)
