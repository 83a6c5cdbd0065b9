"""Left-padding prompts of different lengths into one lock-step batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from blockloop.serve.runners import runner_for


def padded_prompt_length(model: nn.Module, prompts: Sequence[Sequence[int]]) -> int:
    """The batch's prompt length: the longest prompt, rounded up to its runner's ``prompt_multiple``."""
    return runner_for(model).padded(max(len(p) for p in prompts))


def prompt_size(tokens: int, padded: int, noun: str = "prompt") -> str:
    """A prompt's length for an error message: its own tokens, and, where the model reads it padded (a block
    model's whole blocks), the length that counts against the context."""
    return f"{noun} of {tokens} tokens" + (f" ({padded} once left-padded to whole blocks)" if padded != tokens else "")


def left_pad(prompts: Sequence[Sequence[int]], length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, length)`` ids with each prompt right-aligned, and the mask of real (non-padding) tokens."""
    idx = torch.zeros(len(prompts), length, dtype=torch.long, device=device)
    token_valid = torch.zeros(len(prompts), length, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        idx[row, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=device)
        token_valid[row, length - len(prompt) :] = True
    return idx, token_valid
