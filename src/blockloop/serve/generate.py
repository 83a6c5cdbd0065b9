"""Batched, cached generation for every model family: a thin layer over the serving engine.

``generate`` submits each prompt as a request to an :class:`~blockloop.serve.engine.Engine` with one
slot per prompt and runs it to completion, so sampling, stopping and streaming are the engine's, once
for all families. A model takes part through its family's serving runner
(:mod:`blockloop.serve.runners`): lock-step generation is the engine with every prompt admitted at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized

import torch
from torch import nn

from blockloop.errors import BlockloopError, check_context
from blockloop.serve.batching import padded_prompt_length, prompt_size
from blockloop.serve.engine import Engine
from blockloop.serve.requests import Request, SamplingParams, whole_number, wrap_seed
from blockloop.serve.runners import ExitRule, Speculation, runner_for


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
    prefix: Sized | None = None,
    speculation: Speculation | None = None,
    exit_rule: ExitRule | None = None,
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; a row stops early at ``eos_id``.

    ``prompts`` is a list of token-id lists (any lengths) or a ``(B, T)`` tensor of ids. Returns the new
    tokens of each row, without the EOS. ``on_token(row, token)`` is called as tokens
    reach the host (streaming). The same ``seed`` gives the same samples: row ``i`` samples with seed
    ``seed + i``, as the request the server gets with that seed and as a chat's answer ``i`` do. ``prefix`` is a prompt prefix the model cached once (e.g.
    :meth:`DoubleDecoder.cache_prefix`): every prompt continues it. ``speculation`` decodes a looped model
    self-speculatively (:mod:`blockloop.serve.runners.speculative`): the same greedy tokens, the same
    sampling distribution (other samples for a seed), fewer full-depth passes. ``exit_rule`` batches a looped
    model depth-wise and lets each token leave its loops early by that rule (RRT section 2.4).
    """
    prompts = _prompt_rows(prompts)
    if not prompts:
        raise BlockloopError("no prompts given; pass a list of token-id lists, one per row")
    if any(len(p) == 0 for p in prompts):
        raise BlockloopError("every prompt needs at least one token; give a non-empty --prompt")
    if seed is not None and not whole_number(seed):  # it is added to each row's index before any request checks it
        raise BlockloopError(f"seed must be an integer, got {seed!r}")
    if not (whole_number(max_new_tokens) and max_new_tokens >= 1):
        raise BlockloopError(f"max_new_tokens must be a whole number, at least 1; got {max_new_tokens!r}")
    longest = padded_prompt_length(model, prompts)
    need = (len(prefix) if prefix is not None else 0) + longest + max_new_tokens
    size = prompt_size(max(len(p) for p in prompts), longest)
    shared = f" after a shared prefix of {len(prefix)} tokens" if prefix is not None else ""
    runner = runner_for(model, prefix=prefix, speculation=speculation, exit_rule=exit_rule)
    if not runner.streams:  # a streaming model (a staircase, Transformer-XL) reads on past its context
        check_context(need, model.config.context_length, f"{size} plus {max_new_tokens} new tokens{shared}, in all",
                      "shorten the prompt or lower --max-new-tokens")
    base = seed if seed is not None else int(torch.randint(2**31, ()).item())
    was_training = model.training
    try:
        # Slots as long as these requests need (plus a speculative round's drafts past the last token), not
        # the whole context: every decode step reads the whole cache.
        engine = Engine(runner, len(prompts),
                        max_len=need if runner.streams else min(need + runner.emits, model.config.context_length))
        rows: dict[int, int] = {}

        def stream(request: Request, token: int) -> None:
            on_token(rows[request.id], token)

        requests = [
            engine.submit(prompt, max_new_tokens, eos_id=eos_id, on_token=None if on_token is None else stream,
                          sampling=SamplingParams(temperature, top_k, top_p, seed=wrap_seed(base + row)))
            for row, prompt in enumerate(prompts)
        ]
        rows.update((r.id, row) for row, r in enumerate(requests))
        engine.run()
    finally:
        model.train(was_training)
    return [r.output for r in requests]


def _prompt_rows(prompts: Sequence[Sequence[int]] | torch.Tensor) -> list[Sequence[int]]:
    """The batch as one id sequence per row: a ``(B, T)`` tensor is read row by row (nanoGPT's ``idx``); one flat
    prompt, a string or a 1-D tensor is refused rather than read as a batch of one-token prompts."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise BlockloopError(f"a tensor of prompts has shape (batch, length), got {tuple(prompts.shape)}; "
                                 "for one prompt pass prompt[None] or [ids]")
        return prompts.tolist()
    rows = [prompts] if isinstance(prompts, (str, bytes)) else list(prompts)
    if any(isinstance(p, (str, bytes)) or not isinstance(p, Sequence | torch.Tensor) for p in rows):
        raise BlockloopError("prompts is a list of token-id lists, one per row; for one prompt pass [ids], and "
                             "encode text with the model's tokenizer first")
    return rows
