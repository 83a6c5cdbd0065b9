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


def left_pad(
    prompts: Sequence[Sequence[int]], length: int, device: torch.device, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, length)`` ids with each prompt right-aligned after ``pad_id`` (a runner's :attr:`Runner.pad_id`:
    what a Block Transformer's blocks are padded with), and the mask of real (non-padding) tokens."""
    rows = [[pad_id] * (length - len(prompt)) + list(prompt) for prompt in prompts]
    lengths = torch.tensor([len(prompt) for prompt in prompts])
    token_valid = torch.arange(length) >= length - lengths[:, None]
    return torch.tensor(rows, dtype=torch.long).to(device), token_valid.to(device)  # one copy each to the device
