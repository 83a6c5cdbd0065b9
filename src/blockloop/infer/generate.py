"""Batched, cached generation for every model family.

A model takes part by implementing two methods:

* ``prefill(idx, token_valid, max_new_tokens) -> (logits, state)``: run the left-padded prompts
  ``idx (B, P)`` (``token_valid`` marks real tokens), allocate whatever static caches it needs for
  ``max_new_tokens`` more tokens, and return the next-token logits ``(B, V)`` and its decoding state;
* ``decode_step(state, token) -> logits``: feed one token per row and return the next logits.

Prompts of different lengths are left-padded into one batch (to a multiple of ``prompt_multiple`` when a
model works in fixed blocks) so every row advances in lock step; models mask the padding, so a row's
continuation does not depend on what else is in the batch. Sampling, stopping and streaming live here,
once, for all families.
"""

from __future__ import annotations

from typing import Callable, Sequence, Sized

import torch
from torch import nn

from blockloop.errors import BlockloopError
from blockloop.infer.sampling import sample

TokenCallback = Callable[[int, int], None]


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    on_token: TokenCallback | None = None,
    prefix: Sized | None = None,
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; a row stops early at ``eos_id``.

    Returns the new tokens of each row, without the EOS. ``on_token(row, token)`` is called as each
    token is produced (streaming). The same ``seed`` gives the same samples. ``prefix`` is a prompt
    prefix the model cached once (e.g. :meth:`DoubleDecoder.cache_prefix`): every prompt continues it.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise BlockloopError("every prompt needs at least one token; give a non-empty --prompt")
    if max_new_tokens < 1:
        raise BlockloopError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    context = model.config.context_length
    longest = padded_prompt_length(model, prompts)
    if (len(prefix) if prefix is not None else 0) + longest + max_new_tokens > context:
        raise BlockloopError(
            f"prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds the model context of "
            f"{context}; shorten the prompt or lower --max-new-tokens"
        )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        prefill_kwargs = {} if prefix is None else {"prefix": prefix}
        return _generate(
            model, prompts, max_new_tokens, longest, device, temperature, top_k, top_p, eos_id, seed, on_token, prefill_kwargs
        )
    finally:
        model.train(was_training)


def _generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    longest: int,
    device: torch.device,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    eos_id: int | None,
    seed: int | None,
    on_token: TokenCallback | None,
    prefill_kwargs: dict[str, object],
) -> list[list[int]]:
    idx, token_valid = left_pad(prompts, longest, device)
    vocab_size = model.config.vocab_size
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    logits, state = model.prefill(idx, token_valid, max_new_tokens, **prefill_kwargs)
    out = torch.zeros(len(prompts), max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    steps = max_new_tokens
    for step in range(max_new_tokens):
        # Padding ids of the embedding table are never sampled.
        token = sample(logits[:, :vocab_size], temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        out[:, step] = token
        if on_token is not None:
            for row, (tok, done) in enumerate(zip(token.tolist(), finished.tolist())):
                if not done and tok != eos_id:
                    on_token(row, tok)
        if eos_id is not None:
            finished |= token == eos_id
            # Checking on the host costs a sync, so only every few steps; rows that already finished
            # keep sampling until then and their extra tokens are cut below.
            if step % 8 == 7 and bool(finished.all()):
                steps = step + 1
                break
        if step + 1 < max_new_tokens:
            logits = model.decode_step(state, token)

    results = []
    for row in out[:, :steps].tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id)]
        results.append(row)
    return results


def padded_prompt_length(model: nn.Module, prompts: Sequence[Sequence[int]]) -> int:
    """The batch's prompt length: the longest prompt, rounded up to the model's ``prompt_multiple``."""
    multiple = getattr(model, "prompt_multiple", 1)
    longest = max(len(p) for p in prompts)
    return -(-longest // multiple) * multiple


def left_pad(prompts: Sequence[Sequence[int]], length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, length)`` ids with each prompt right-aligned, and the mask of real (non-padding) tokens."""
    idx = torch.zeros(len(prompts), length, dtype=torch.long, device=device)
    token_valid = torch.zeros(len(prompts), length, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        idx[row, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=device)
        token_valid[row, length - len(prompt) :] = True
    return idx, token_valid
