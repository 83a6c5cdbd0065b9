"""Batched, cached generation for decoder models.

Prompts of different lengths are left-padded into one batch so every row writes its next token at the
same cache slot; padding is masked out of attention and each row's rotary positions start at its own
first real token, so a row's continuation does not depend on what else is in the batch. One prefill
pass fills the static cache, then each step feeds one token per row.
"""

from __future__ import annotations

from typing import Callable, Sequence

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
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; a row stops early at ``eos_id``.

    Returns the new tokens of each row, without the EOS. ``on_token(row, token)`` is called as each
    token is produced (streaming). The same ``seed`` gives the same samples.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise BlockloopError("every prompt needs at least one token; give a non-empty --prompt")
    if max_new_tokens < 1:
        raise BlockloopError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    context = model.config.context_length
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > context:
        raise BlockloopError(
            f"prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds the model context of "
            f"{context}; shorten the prompt or lower --max-new-tokens"
        )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        return _generate(model, prompts, max_new_tokens, longest, device, temperature, top_k, top_p, eos_id, seed, on_token)
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
) -> list[list[int]]:
    batch = len(prompts)
    vocab_size = model.config.vocab_size
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    pad = longest - lengths
    idx = torch.zeros(batch, longest, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        idx[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long, device=device)
    slots = torch.arange(longest, device=device)
    token_valid = slots[None, :] >= pad[:, None]
    positions = (slots[None, :] - pad[:, None]).clamp_min(0)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    cache = model.allocate_cache(batch, longest + max_new_tokens)
    logits, _ = model(idx, cache=cache, slots=slots, positions=positions, token_valid=token_valid, last_only=True)
    out = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    steps = max_new_tokens
    for step in range(max_new_tokens):
        next_logits = logits[:, -1, :vocab_size]  # padding ids of the embedding table are never sampled
        token = sample(next_logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
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
            slot = torch.full((1,), longest + step, device=device)
            logits, _ = model(token[:, None], cache=cache, slots=slot, positions=(lengths + step)[:, None])

    results = []
    for row in out[:, :steps].tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id)]
        results.append(row)
    return results
