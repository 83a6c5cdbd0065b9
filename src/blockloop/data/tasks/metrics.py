"""Scoring labelled-position tasks: only the positions that carry a label count.

Most positions of a state-tracking stream ask nothing (label :data:`IGNORE_INDEX`); averaging over them
would drown the few that test the state, so the error is taken over labelled positions only, as in
Fan et al. (2020) and the Staircase paper.
"""

from __future__ import annotations

import torch

from blockloop.data.tasks.base import IGNORE_INDEX


def labelled_errors(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(wrong, labelled): argmax mistakes and labelled positions as 0-dim tensors on the logits' device,
    to sum over batches without a host sync before dividing.

    ``logits`` is ``(..., vocab)`` and ``labels`` the matching ``(...)`` ids, ``IGNORE_INDEX`` where
    nothing is asked.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    asked = labels != IGNORE_INDEX
    wrong = (logits.argmax(dim=-1) != labels) & asked
    return wrong.sum(), asked.sum()


def task_error(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of labelled positions whose argmax prediction is wrong (0 = solved)."""
    wrong, labelled = labelled_errors(logits, labels)
    if int(labelled) == 0:
        raise ValueError("no labelled positions to score")
    return int(wrong) / int(labelled)
