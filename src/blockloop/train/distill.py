"""Knowledge distillation from a frozen teacher during uptraining (Bae et al. 2024, appendix L).

The student's LM loss gets ``weight`` times the forward KL from the teacher's next-token distribution
(the full-size model the student was converted from, run without gradients). The teacher lives in this
loss hook, not in the model, so it never reaches the optimizer or a checkpoint; the run records its path
and weight in ``TrainConfig.extra`` so ``--resume`` rebuilds the same hook.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from blockloop.errors import BlockloopError
from blockloop.nn.distill import forward_kl


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


def build_distillation(extra: dict[str, Any], student_config: Any, device: torch.device | str) -> Distillation | None:
    """The hook a run's ``TrainConfig.extra`` asks for (``distill_from``, ``distill_weight``), or None."""
    source = extra.get("distill_from")
    if source is None:
        return None
    from blockloop.train.run import load_trained

    teacher = load_trained(source, str(device))
    if teacher.config.padded_vocab_size != student_config.padded_vocab_size:
        raise BlockloopError(
            f"teacher {source} has {teacher.config.padded_vocab_size} vocabulary rows, the student "
            f"{student_config.padded_vocab_size}: distill from the model the student was converted from"
        )
    return Distillation(teacher.model, float(extra.get("distill_weight", 1.0)))
