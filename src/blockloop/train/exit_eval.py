"""Static early-exit evaluation of a recursive model (Bae et al. 2024, sections 3.7-3.8, appendix M).

Every token exits after loop i = 1..B through the shared final norm and LM head: per loop, the loss,
next-token accuracy, and the agreement rate of its argmax with the final loop's. The oracle exit of a
token (section 3.8, appendix N) is the earliest loop whose prediction equals the final loop's; the share
of tokens per oracle exit loop and the mean loops per token bound what early exiting could save.
"""

from __future__ import annotations

import math

import torch

from blockloop.data.loader import PackedSequences, eval_batches
from blockloop.errors import BlockloopError
from blockloop.models.recursive import RecursiveDecoder
from blockloop.nn.loss import IGNORE_INDEX, token_cross_entropy
from blockloop.nn.precision import at_least_fp32


@torch.no_grad()
def evaluate_loops(
    model: torch.nn.Module,
    sequences: PackedSequences,
    *,
    batch_size: int,
    max_batches: int | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, object]:
    """``{"loops": [{loop, loss, perplexity, accuracy, agreement, oracle_exit_share}, ...], "mean_exit_loop", "tokens"}``."""
    if not isinstance(model, RecursiveDecoder):
        family = getattr(getattr(model, "config", None), "family", type(model).__name__)
        raise BlockloopError(f"--per-loop scores each loop of a recursive model; this model is of the {family} family, "
                             "which has no loops: leave --per-loop out")
    was_training = model.training
    model.eval()
    loops = model.config.loops
    nats = torch.zeros(loops, dtype=torch.float64, device=device)
    correct = torch.zeros(loops, dtype=torch.long, device=device)
    agree = torch.zeros(loops, dtype=torch.long, device=device)
    exits = torch.zeros(loops, dtype=torch.long, device=device)
    tokens = torch.zeros((), dtype=torch.long, device=device)  # sums stay on the device: one host sync at the end
    try:  # back in the caller's mode also when a batch fails
        for inputs, targets in eval_batches(sequences, batch_size, max_batches):
            inputs, targets = inputs.to(device), targets.to(device)
            # The softmax over every row of the head, as training and `evaluate` take it, so the last loop's loss
            # is the model's evaluation loss; ``IGNORE_INDEX`` targets (a task's prompt positions) are not scored.
            per_loop = [at_least_fp32(logits) for logits in model.loop_logits(inputs)]
            scored = targets != IGNORE_INDEX
            preds = torch.stack([logits.argmax(-1) for logits in per_loop])  # (loops, B, T)
            for i, logits in enumerate(per_loop):
                nats[i] += token_cross_entropy(logits, targets, reduction="sum").double()
            correct += ((preds == targets) & scored).flatten(1).sum(1)
            matches = preds == preds[-1]
            agree += (matches & scored).flatten(1).sum(1)
            first = matches.long().argmax(0)  # earliest loop agreeing with the last (the last always agrees)
            exits += torch.bincount(first.masked_fill(~scored, loops).flatten(), minlength=loops + 1)[:loops]
            tokens += scored.sum()
    finally:
        model.train(was_training)
    tokens = int(tokens)
    if tokens == 0:
        raise BlockloopError("evaluation saw no tokens; use a longer split or a shorter --seq-len")
    rows = []
    for i in range(loops):
        loss = nats[i].item() / tokens
        rows.append({
            "loop": i + 1, "loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "accuracy": correct[i].item() / tokens, "agreement": agree[i].item() / tokens,
            "oracle_exit_share": exits[i].item() / tokens,
        })
    mean_exit = sum(r["loop"] * r["oracle_exit_share"] for r in rows)
    return {"loops": rows, "mean_exit_loop": mean_exit, "tokens": tokens}
