"""Scoring a trained checkpoint: on a corpus split, on a labelled-position task, or loop by loop.

What ``blockloop eval`` reports, as one dict a caller can print or store: the data (or task) and split that
were scored, with the metrics of :func:`blockloop.train.evaluate.evaluate` (or, per loop,
:func:`blockloop.train.exit_eval.evaluate_loops`). Left-out choices default to what the run trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from blockloop.data.dataset import prepare_tokens
from blockloop.data.loader import PackedSequences
from blockloop.data.tasks import get_task, open_task
from blockloop.data.tasks.tokenizer import refuse_text
from blockloop.device import resolve_device
from blockloop.errors import BlockloopError, check_context
from blockloop.families import spec_of
from blockloop.train.evaluate import evaluate
from blockloop.train.exit_eval import evaluate_loops
from blockloop.train.run import (
    TrainedModel,
    check_learns_tasks,
    check_task_vocabulary,
    default_seq_len,
    load_trained,
    task_sequences,
)


@dataclass
class EvalRequest:
    """What to score; None means "what the run trained on" (its data or task, window length and objective)."""

    data: str | None = None
    split: str | None = None  # train, val or all of a corpus; train, valid (= val) or test of a task
    task: str | None = None
    task_dir: str | None = None
    seq_len: int | None = None
    batch_size: int = 8
    max_batches: int | None = None
    objective: str | None = None
    per_loop: bool = False  # a looped model's static exit after every loop


def evaluate_checkpoint(checkpoint: str | Path, request: EvalRequest, device: str = "auto") -> dict[str, Any]:
    """``{"data", "split", "objective", **metrics}`` for a corpus, ``{"data", "split", **per-loop metrics}`` with
    ``per_loop``, or ``{"task", "split", **metrics}`` for a task (the one the run trained on, or the one named)."""
    if request.batch_size < 1:
        raise BlockloopError(f"--batch-size must be at least 1, got {request.batch_size}")
    if request.max_batches is not None and request.max_batches < 1:  # the CLI refuses it as a flag; here by name
        raise BlockloopError(f"max_batches (--max-batches) must be at least 1 or None (all), got {request.max_batches}")
    device = resolve_device(device)
    trained = load_trained(checkpoint, device)
    run = trained.state.get("run", {})
    if request.task or request.task_dir or (request.data is None and (run.get("task") or run.get("task_dir"))):
        return evaluate_task(trained, request, device)
    if request.split == "test":
        raise BlockloopError("a corpus is scored on its train or val split, or all of it; --split test is for tasks (--task)")
    split = "val" if request.split in (None, "valid") else request.split
    refuse_text(trained.tokenizer, "leave --data out to score it on its task")
    data = request.data or run.get("data")
    if data is None:
        raise BlockloopError("the checkpoint does not record its data; pass --data")
    seq_len = _seq_len(trained, request)
    spec = spec_of(trained.config)
    spec.check_seq_len(trained.config, seq_len)
    if request.per_loop and request.objective not in (None, "lm"):
        raise BlockloopError(f"--per-loop scores every next token after each loop; drop --objective {request.objective}")
    objective = request.objective or trained.state.get("train_config", {}).get("objective", "lm")
    splits = prepare_tokens(data, trained.tokenizer)
    # all: a held-out corpus is scored whole (train before val is the text's order when one document was cut in two)
    tokens = np.concatenate([splits.train, splits.val]) if split == "all" else getattr(splits, split)
    seqs = PackedSequences(tokens, seq_len, trained.tokenizer.start_id,
                           description=f"all of {data}" if split == "all" else f"the {split} split of {data}")
    if request.per_loop:
        metrics = evaluate_loops(
            trained.model, seqs, batch_size=request.batch_size, max_batches=request.max_batches, device=device
        )
        return {"data": data, "split": split, **metrics}
    metrics = evaluate(
        trained.model, seqs, batch_size=request.batch_size, max_batches=request.max_batches,
        byte_lengths=trained.tokenizer.token_byte_lengths(), device=device, objective=objective, show_progress=True,
    )
    scored = spec.loss_scores(objective)
    if scored == "span corruption":  # its targets are spans and sentinels, not the text's bytes in order
        metrics.pop("bits_per_byte", None)
    return {"data": data, "split": split, "objective": objective, "scored": scored, **metrics}


def evaluate_task(trained: TrainedModel, request: EvalRequest, device: str) -> dict[str, Any]:
    """Loss and argmax error over the labelled positions of one split of a task (default: the run's, valid)."""
    if request.data:
        raise BlockloopError("--data names a corpus and --task a task; give one of them")
    if request.objective is not None:
        raise BlockloopError("--objective chooses what of a text is scored; a task scores its labelled positions: "
                             "drop --objective")
    if request.per_loop:
        raise BlockloopError("--per-loop scores a corpus's text after every loop; a task is scored at the model's "
                             "output: drop --per-loop")
    check_learns_tasks(trained.config)
    run = trained.state.get("run", {})
    if request.task or request.task_dir:
        name, directory = request.task, request.task_dir
    else:
        name, directory = run.get("task"), run.get("task_dir")
        if directory is not None and not Path(directory).is_dir():
            raise BlockloopError(f"the run trained on task {name} from {directory}, which is gone; pass --task-dir")
    if directory is None:  # a built-in task: a wrong model fails before the task is generated
        check_task_vocabulary(trained.tokenizer, name, get_task(name).vocab)
    data = open_task(name, directory, context=trained.config.context_length)
    check_task_vocabulary(trained.tokenizer, data.name, data.vocab)
    split = {None: "valid", "val": "valid"}.get(request.split, request.split)
    if split == "all":
        raise BlockloopError("a task is scored one split at a time; give --split train, valid or test")
    metrics = evaluate(
        trained.model, task_sequences(data, split, _seq_len(trained, request),
                                      spec_of(trained.config).sequence_multiple(trained.config)), batch_size=request.batch_size,
        max_batches=request.max_batches, device=device, show_progress=True,
    )
    return {"task": data.name, "split": split, **metrics}


def _seq_len(trained: TrainedModel, request: EvalRequest) -> int:
    """The window: as asked, else the run's training ``seq_len``, else (an imported model) the default training
    window: the whole context of a large model would hold gigabytes of logits at once."""
    seq_len = request.seq_len or trained.state.get("train_config", {}).get("seq_len") or default_seq_len(trained.config)
    check_context(seq_len, trained.config.context_length, "--seq-len window", "lower --seq-len")
    return seq_len
