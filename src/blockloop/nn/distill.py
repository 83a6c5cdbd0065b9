"""Forward KL divergence between two next-token distributions, the distillation term of every KD loss here.

KL(p_teacher || p_student) per scored token (targets not ``IGNORE_INDEX``), averaged: the "forward" direction used for
uptraining from a full-size teacher (Bae et al. 2024, appendix L, Table 9) and for early-exit KD from the detached
final loop (section 3.7).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from blockloop.nn.loss import IGNORE_INDEX
from blockloop.nn.precision import at_least_fp32


def forward_kl(teacher_logits: Tensor, student_logits: Tensor, targets: Tensor | None = None) -> Tensor:
    """Mean over positions of sum_v p_t(v) (log p_t(v) - log p_s(v)); positions with target ``IGNORE_INDEX`` do not
    count."""
    t = F.log_softmax(at_least_fp32(teacher_logits), dim=-1)
    s = F.log_softmax(at_least_fp32(student_logits), dim=-1)
    per_token = (t.exp() * (t - s)).sum(-1)
    if targets is None:
        return per_token.mean()
    scored = targets != IGNORE_INDEX
    return (per_token * scored).sum() / scored.sum().clamp_min(1)
