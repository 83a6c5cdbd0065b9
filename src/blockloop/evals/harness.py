"""From questions to ``acc`` / ``acc_norm`` with standard errors, as lm-evaluation-harness 0.4.13 computes them.

Per question, ``acc`` is 1 when the choice with the highest summed log-likelihood is the gold one, and
``acc_norm`` when the highest log-likelihood divided by the choice's length in characters is (lm-eval's
``completion_len``; ties go to the first choice, as ``numpy.argmax``). A task's value is the mean over its
questions and its standard error the sample standard deviation over sqrt(n) (lm-eval's ``mean_stderr``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch import nn

import blockloop
from blockloop.bench.records import environment
from blockloop.data.tasks.tokenizer import TaskTokenizer
from blockloop.data.tokenizers import Tokenizer
from blockloop.device import resolve_device
from blockloop.errors import BlockloopError
from blockloop.evals.benchmarks_data import load_rows
from blockloop.evals.scoring import check_requests, cut_questions, encode_request, score
from blockloop.evals.tasks import TASKS, Question, build_questions, parse_tasks
from blockloop.train.run import load_trained


@dataclass
class BenchmarkRequest:
    """What to run: task names, examples per question, the first ``limit`` questions, questions per forward,
    the few-shot seed, and for a looped model the exit loop (``loops``) or every loop (``per_loop``)."""

    tasks: list[str]
    shots: int = 0
    limit: int | None = None
    batch_size: int = 8
    seed: int = 1234
    loops: int | None = None
    per_loop: bool = False

    def __post_init__(self) -> None:
        # "copa,piqa" or a list, checked as --tasks is: a bare string would be read a letter at a time
        self.tasks = parse_tasks(self.tasks if isinstance(self.tasks, str) else ",".join(self.tasks))


def mean_stderr(values: list[float]) -> tuple[float, float | None]:
    """The mean and its standard error (sample standard deviation / sqrt(n); None for fewer than 2 values, which
    lm-eval reports as NaN: JSON has no NaN)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def question_metrics(question: Question, loglikelihoods: list[float]) -> dict[str, float]:
    """``acc`` and ``acc_norm`` of one answered question."""
    normed = [ll / length for ll, length in zip(loglikelihoods, question.norm_lengths)]
    return {"acc": float(argmax(loglikelihoods) == question.gold), "acc_norm": float(argmax(normed) == question.gold)}


def exits_of(model: nn.Module, request: BenchmarkRequest) -> list[int] | None:
    """The loops whose static exits are scored (None: the model's own output)."""
    if request.loops is None and not request.per_loop:
        return None
    if request.loops is not None and request.per_loop:
        raise BlockloopError("--per-loop scores every loop's exit and --loops K one of them; give one of the two")
    loops = getattr(model.config, "loops", None)
    if loops is None:
        raise BlockloopError("--loops / --per-loop score a looped model's exits; this model has no loops")
    if request.per_loop:
        return list(range(1, loops + 1))
    if not 1 <= request.loops <= loops:
        raise BlockloopError(f"--loops {request.loops} is outside the model's 1..{loops} loops")
    return [request.loops]


def run_benchmarks(
    model: nn.Module,
    tokenizer: Tokenizer,
    request: BenchmarkRequest,
    *,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
    rows: Callable[[str], list[dict[str, Any]]] | None = None,
    on_task: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """``{"results": [{task, metric, value, stderr, n, shots, limit[, loop]}...], "seconds": {task: s}}``.

    ``progress(task, n_questions)`` may return a callback told how many questions are done; ``rows(dataset)``
    replaces the shipped data (tests); ``on_task`` is given the record so far as each task is scored, so an
    evaluation stopped part way can keep the tasks it finished."""
    if isinstance(tokenizer, TaskTokenizer):
        raise BlockloopError(f"this model reads the words of task {tokenizer.task}, not text, so it cannot answer the "
                             "benchmarks; score it on its task with `blockloop eval --checkpoint RUN` (no --tasks)")
    exits = exits_of(model, request)
    # Every task's questions first: a request one task cannot meet (too many --shots, a continuation longer
    # than the model context) fails before any scoring.
    prepared, refused = [], []
    for name in request.tasks:
        questions = build_questions(TASKS[name], (rows or load_rows)(TASKS[name].dataset), shots=request.shots,
                                    limit=request.limit, seed=request.seed)
        groups = [[encode_request(tokenizer, c, x) for c, x in q.pairs] for q in questions]
        try:
            check_requests(model, groups)
        except BlockloopError as exc:
            refused.append(f"{name}: {exc}")
        prepared.append((name, questions, groups, cut_questions(model, groups)))
    if refused:  # every task that cannot be scored, in one line: not one per run
        raise BlockloopError("; ".join(refused))
    results, seconds = [], {}
    for name, questions, groups, cut in prepared:
        task = TASKS[name]
        start = time.perf_counter()
        scores = score(model, groups, exits=exits, batch_size=request.batch_size,
                       progress=progress(name, len(questions)) if progress else None)
        seconds[name] = time.perf_counter() - start
        for e, loop in enumerate(exits or [None]):
            per_question, row = [], 0
            for q in questions:
                per_question.append(question_metrics(q, scores.loglikelihood[row : row + len(q.pairs), e].tolist()))
                row += len(q.pairs)
            for metric in task.metrics:
                value, stderr = mean_stderr([m[metric] for m in per_question])
                result = {"task": name, "metric": metric, "value": value, "stderr": stderr, "n": len(questions),
                          "shots": request.shots, "limit": request.limit, "cut": cut}
                if request.shots:  # which examples were drawn
                    result["seed"] = request.seed
                results.append(result if loop is None else {**result, "loop": loop})
        if on_task is not None:
            on_task({"results": list(results), "seconds": dict(seconds)})
    return {"results": results, "seconds": seconds}


def evaluate_benchmarks(checkpoint: str | Path, request: BenchmarkRequest, device: str = "auto",
                        *, progress: Callable[[str, int], Callable[[int], None]] | None = None,
                        on_task: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """:func:`run_benchmarks` on a checkpoint, with what produced the numbers (model, checkpoint, tokenizer,
    versions, date) for the JSON record; ``on_task`` is given that record so far as each task is scored."""
    device = resolve_device(device)
    trained = load_trained(checkpoint, device)
    about = {
        "model": {"family": trained.config.family, "parameters": sum(p.numel() for p in trained.model.parameters()),
                  "loops": getattr(trained.config, "loops", None)},
        "checkpoint": str(trained.directory.resolve()), "tokenizer": trained.tokenizer.name,
        "blockloop": blockloop.__version__,
        **environment(device),
    }
    record = run_benchmarks(trained.model, trained.tokenizer, request, progress=progress,
                            on_task=None if on_task is None else lambda so_far: on_task({**about, **so_far}))
    return {**about, **record}
