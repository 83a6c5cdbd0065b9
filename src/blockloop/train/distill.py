"""Knowledge distillation from a frozen teacher during uptraining (Bae et al. 2024, appendix L).

The student's LM loss gets ``weight`` times the forward KL from the teacher's next-token distribution
(the full-size model the student was converted from, run without gradients). The teacher lives in this
loss hook, not in the model, so it never reaches the optimizer or a checkpoint; the run records its path
and weight in the run's :class:`TrainConfig` so ``--resume`` rebuilds the same hook.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from blockloop.data.tokenizers import Tokenizer
from blockloop.errors import BlockloopError
from blockloop.nn.distill import forward_kl
from blockloop.train.config import TrainConfig


class Distillation:
    """``loss_hook(batch, logits, loss) -> loss + weight * KL(teacher || student)`` for the trainer."""

    def __init__(self, teacher: nn.Module, weight: float) -> None:
        if weight <= 0:
            raise BlockloopError(f"--distill-weight must be positive, got {weight}")
        self.teacher, self.weight = teacher.eval().requires_grad_(False), weight

    def __call__(self, batch: dict[str, Tensor], logits: Tensor, loss: Tensor) -> Tensor:
        with torch.no_grad():
            teacher_logits, _ = self.teacher(batch["idx"])
        return loss + self.weight * forward_kl(teacher_logits, logits, batch.get("targets"))


def build_distillation(train: TrainConfig, student_config: Any, tokenizer: Tokenizer,
                       device: torch.device | str) -> Distillation | None:
    """The hook a run's ``distill_from`` and ``distill_weight`` ask for, or None.

    The teacher must read the student's windows as the student does (the same token ids, windows of
    ``train.seq_len`` within its context) and both must predict the next token at each position: otherwise the
    KL compares distributions over other tokens or other positions, and training goes on without a word."""
    source, seq_len = train.distill_from, train.seq_len
    if source is None:
        return None
    from blockloop.families import spec_of
    from blockloop.train.run import load_trained

    if not Path(source).exists():  # pinned when the run started; the teacher's run keeps only its newest checkpoints
        raise BlockloopError(f"the teacher this run distils from, {source}, is gone (its run has trained on and removed "
                             "it, or it moved); name the teacher again: train --resume --distill-from TEACHER_RUN")
    teacher = load_trained(source, str(device))
    for role, config in (("student", student_config), ("teacher", teacher.config)):
        if not spec_of(config).next_token_windows:
            raise BlockloopError(f"the {role} ({config.family} family) does not predict the next token at each "
                                 "position of its window; distill between decoder-style models (decoder, recursive, ...)")
    if teacher.tokenizer.fingerprint() != tokenizer.fingerprint():
        raise BlockloopError(f"teacher {source} reads text with tokenizer {teacher.tokenizer.name}, the student with "
                             f"{tokenizer.name}: their ids mean other tokens; distill from a model with the student's tokenizer")
    if teacher.config.padded_vocab_size != student_config.padded_vocab_size:
        raise BlockloopError(
            f"teacher {source} has {teacher.config.padded_vocab_size} vocabulary rows, the student "
            f"{student_config.padded_vocab_size}: distill from the model the student was converted from"
        )
    if teacher.config.context_length < seq_len:
        raise BlockloopError(f"teacher {source} has a context of {teacher.config.context_length} tokens, shorter than "
                             f"the --seq-len {seq_len} windows it would read; lower --seq-len")
    return Distillation(teacher.model, float(train.distill_weight))
