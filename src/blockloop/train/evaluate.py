"""Validation metrics: mean token loss, perplexity and bits per byte over a token split.

Bits per byte divides the summed loss (in bits) by the UTF-8 bytes the scored tokens stand for, so
models with different tokenizers can be compared on the same text. On a labelled-position task
(:class:`~blockloop.data.tasks.TaskSequences`) the task error is added: the argmax error over the
labelled positions only, the number the Staircase paper reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import torch
from torch import nn

from blockloop import progress
from blockloop.data.collate import step_generator
from blockloop.data.loader import PackedSequences, eval_batches, stream_eval_batches
from blockloop.data.tasks.metrics import labelled_errors
from blockloop.data.tasks.windows import TaskSequences
from blockloop.errors import BlockloopError
from blockloop.families import family, spec_of
from blockloop.nn.loss import IGNORE_INDEX, token_cross_entropy
from blockloop.train.distributed import DistInfo, sum_across_ranks


class EvaluationStopped(Exception):
    """An evaluation ended before its last batch because ``stopped()`` asked it to."""


@torch.no_grad()
def evaluate(
    model: nn.Module,
    sequences: PackedSequences | TaskSequences,
    *,
    batch_size: int,
    max_batches: int | None = None,
    byte_lengths: np.ndarray | None = None,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
    objective: str = "lm",
    show_progress: bool = False,
    dist: DistInfo | None = None,
    stopped: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Loss/perplexity (and bits per byte when ``byte_lengths`` per token id is given).

    The model's own collator shapes each batch (with fixed seeds, so every evaluation sees the same
    batches) for ``objective``; the loss is summed over the targets it keeps (``IGNORE_INDEX`` dropped).
    Ids beyond the tokenizer's (span-corruption sentinels) count no bytes. Sources with labelled
    positions also get ``error``, the fraction of scored positions whose argmax is wrong. ``show_progress``
    draws a bar over the batches (a standalone evaluation can take minutes; inside training it stays off).

    Under torchrun (``dist``) the ranks share the batches one process of ``batch_size x world_size`` rows would
    read, ``batch_size`` rows each, and add up their sums: the metrics do not depend on the number of processes,
    and no rank scores what another does. A rank left without rows in a short last batch still runs the model on
    a stand-in row that is not counted, because FSDP gathers weights in every rank's forward together.

    ``stopped()`` is asked before each batch; when it says so the evaluation ends at once with
    :class:`EvaluationStopped` (training's validation, on a Ctrl-C or a scheduler's stop: a large validation can
    outlast the stop's grace period).
    """
    was_training = model.training
    model.eval()
    device = torch.device(device)
    # Sums stay on the device: one host sync at the end, not one per batch.
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    total_tokens = torch.zeros((), dtype=torch.long, device=device)
    total_bytes = torch.zeros((), dtype=torch.long, device=device)
    total_wrong = torch.zeros((), dtype=torch.long, device=device)
    labelled = getattr(sequences, "labelled_positions", False)
    lengths = torch.as_tensor(byte_lengths, dtype=torch.long, device=device) if byte_lengths is not None else None
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    # The model itself under torch.compile; a module without a config is batched like a plain decoder.
    config = getattr(getattr(model, "_orig_mod", model), "config", None)
    spec = family("decoder") if config is None else spec_of(config)
    collate = spec.collate(config, objective)
    # Recurrent models read the split as side-by-side streams and carry their state from batch to batch.
    recurrent = spec.recurrent(config)
    chunk = spec.sequence_multiple(config) if recurrent else 1
    # Independent windows (task windows overlap, each holds whole sequences) are each read from an empty state.
    recurrent = recurrent and not getattr(sequences, "independent_windows", False)
    if sequences.seq_len % chunk:
        fit = -(-sequences.seq_len // chunk) * chunk
        raise BlockloopError(
            f"--seq-len {sequences.seq_len} is not a multiple of the model's chunk size {chunk}; "
            f"use a multiple of {chunk}, e.g. --seq-len {fit}"
        )
    rank, world_size = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    rows = batch_size * world_size  # the batch one process would read; this rank's share is slice ``mine``
    mine = slice(rank * batch_size, (rank + 1) * batch_size)
    batches = (stream_eval_batches if recurrent else eval_batches)(sequences, rows, max_batches)
    count = (len(sequences) // min(rows, len(sequences)) if recurrent
             else -(-len(sequences) // rows))
    batches = progress.bar(iterable=batches, total=count if max_batches is None else min(count, max_batches),
                           desc="evaluating", unit="batch", disable=not show_progress, log_every=60)
    state = None
    try:  # back in the caller's mode also when a batch fails
        for i, (inputs, targets) in enumerate(batches):
            if stopped is not None and stopped():
                raise EvaluationStopped
            counted = inputs[mine].shape[0] > 0
            share = mine if counted else slice(0, 1)
            # The whole batch is shaped, then cut: random padding and span corruption draw row by row, so a rank's
            # rows get the noise they get in one process.
            whole = collate(inputs, targets, step_generator(0, i))
            batch = {k: (v if k in spec.batch_wide_keys else v[share]).to(device) for k, v in whole.items()}
            targets = batch.pop("targets")
            with autocast:
                if recurrent:
                    logits, _, state = model(**batch, state=state, return_state=True)
                else:
                    logits, _ = model(**batch)
            if not counted:
                continue
            nats = token_cross_entropy(logits, targets, reduction="sum")
            scored = targets != IGNORE_INDEX
            total_nats += nats.double()
            total_tokens += scored.sum()
            if labelled:
                total_wrong += labelled_errors(logits, targets)[0]
            if lengths is not None:  # ids past the tokenizer (span-corruption sentinels) count no bytes
                in_vocab = scored & (targets < len(lengths))
                total_bytes += lengths[targets.clamp(0, len(lengths) - 1)][in_vocab].sum()
    finally:
        model.train(was_training)
    if dist is not None:
        total_nats, total_tokens, total_bytes, total_wrong = (
            sum_across_ranks(t, dist) for t in (total_nats, total_tokens, total_bytes, total_wrong))
    total_nats, total_tokens, total_bytes = total_nats.item(), int(total_tokens), int(total_bytes)
    if total_tokens == 0:
        raise BlockloopError("evaluation saw no tokens; use a longer split or a shorter --seq-len")
    loss = total_nats / total_tokens
    metrics = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": float(total_tokens)}
    if lengths is not None and total_bytes:
        metrics["bits_per_byte"] = total_nats / math.log(2) / total_bytes
    if labelled:
        metrics["error"] = int(total_wrong) / total_tokens
    return metrics
