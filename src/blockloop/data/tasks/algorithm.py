"""The Algorithm task (Fan et al. 2020; Staircase attention, section 4.1): run tiny programs in your head.

A program is 100 statements over 3 (``x y z``) or 5 (``x y z u v``) variables holding values 1..10,
followed by ``END``. Each statement kind is drawn uniformly; a draw that is impossible in the current
state is rejected and drawn again (it does not count towards the 100):

* ``v = k ;``: assigns ``k`` (uniform in 1..10) to a variable ``v`` that has no value yet (rejected when
  every variable has one).
* ``v ++ ;`` / ``v -- ;``: ``v`` uniform among the variables with a value; rejected if the result would
  leave 1..10.
* ``print v ;``: the ``;`` is labelled with ``v``'s value, the only labelled position of the task.
* ``if v OP R : S``: ``OP`` is ``<`` or ``>``; ``R`` is, with equal chance, another variable with a value
  or a constant 1..10 (always a constant when ``v`` is the only variable with a value); ``S`` is one of
  the three statements above that change state (never an ``if`` or a ``print``), drawn and rejected by
  the same rules whether or not the condition holds. ``S`` takes effect only if the condition holds.

Every program starts with no variable set; the programs of a split are concatenated into one stream.
The model must output the printed value at each print's ``;``; error is the argmax error there.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from blockloop.data.tasks.base import IGNORE_INDEX, GenerateFn, TaskStream, TaskVocab

STATEMENTS_PER_PROGRAM = 100
LOWEST, HIGHEST = 1, 10
VARIABLES = {3: ("x", "y", "z"), 5: ("x", "y", "z", "u", "v")}
_KINDS = ("assign", "increment", "decrement", "print", "if")
_UPDATES = ("assign", "increment", "decrement")
_VALUE_WORDS = tuple(str(k) for k in range(LOWEST, HIGHEST + 1))
# A statement's words and one label per word.
Statement = tuple[list[str], list[int]]


def algorithm_vocab(num_variables: int) -> TaskVocab:
    symbols = ["=", "++", "--", "print", "if", "<", ">", ":", ";"]
    return TaskVocab(["END", *VARIABLES[num_variables], *symbols, *_VALUE_WORDS])


def generator(num_variables: int, statements: int = STATEMENTS_PER_PROGRAM) -> GenerateFn:
    """The generator of the ``num_variables`` version: ``(count, seed, advance) -> stream of count programs``.

    ``statements`` per program (default 100, the paper's) is lowered only for CPU-sized experiments.

    ``seed`` seeds one ``random.Random`` that draws every choice of every program in order, so the same
    seed gives the same stream (for a given Python version).
    """
    names = VARIABLES[num_variables]
    vocab = algorithm_vocab(num_variables)

    def generate(count: int, seed: int, advance: Callable[[int], None]) -> TaskStream:
        rng = random.Random(seed)
        words: list[str] = []
        labels: list[int] = []
        for _ in range(count):
            _program(rng, names, vocab, words, labels, statements)
            advance(1)
        return TaskStream(
            inputs=np.array([vocab.id(w) for w in words], dtype=np.uint16),
            labels=np.array(labels, dtype=np.int16),
        )

    return generate


def _program(
    rng: random.Random,
    names: tuple[str, ...],
    vocab: TaskVocab,
    words: list[str],
    labels: list[int],
    statements: int,
) -> None:
    """Append one program of ``statements`` statements and its ``END`` to ``words``, one label per word to ``labels``."""
    values: dict[str, int] = {}
    written = 0
    while written < statements:
        kind = rng.choice(_KINDS)
        if kind == "print":
            statement = _print(rng, values, vocab)
        elif kind == "if":
            statement = _conditional(rng, names, values)
        else:
            statement = _update(rng, kind, names, values)
        if statement is None:
            continue
        statement_words, statement_labels = statement
        words += statement_words
        labels += statement_labels
        written += 1
    words.append("END")
    labels.append(IGNORE_INDEX)


def _print(rng: random.Random, values: dict[str, int], vocab: TaskVocab) -> Statement | None:
    if not values:
        return None
    name = rng.choice(sorted(values))
    return ["print", name, ";"], [IGNORE_INDEX, IGNORE_INDEX, vocab.id(str(values[name]))]


def _update(
    rng: random.Random, kind: str, names: tuple[str, ...], values: dict[str, int], apply: bool = True
) -> Statement | None:
    """An assignment, ``++`` or ``--`` (applied to ``values`` only if ``apply``), or None if rejected.

    The range check does not depend on ``apply``: a ``++`` of a 10 is never written, even under an
    ``if`` that turns out false.
    """
    if kind == "assign":
        unset = [name for name in names if name not in values]
        if not unset:
            return None
        name, value = rng.choice(unset), rng.randint(LOWEST, HIGHEST)
        words = [name, "=", str(value), ";"]
    else:
        if not values:
            return None
        name = rng.choice(sorted(values))
        step = 1 if kind == "increment" else -1
        value = values[name] + step
        if not LOWEST <= value <= HIGHEST:
            return None
        words = [name, "++" if step == 1 else "--", ";"]
    if apply:
        values[name] = value
    return words, [IGNORE_INDEX] * len(words)


def _conditional(rng: random.Random, names: tuple[str, ...], values: dict[str, int]) -> Statement | None:
    if not values:
        return None
    name = rng.choice(sorted(values))
    op = rng.choice("<>")
    others = sorted(set(values) - {name})
    if others and rng.random() < 0.5:
        right_word = rng.choice(others)
        right = values[right_word]
    else:
        right = rng.randint(LOWEST, HIGHEST)
        right_word = str(right)
    holds = values[name] < right if op == "<" else values[name] > right
    body = _update(rng, rng.choice(_UPDATES), names, values, apply=holds)
    if body is None:
        return None
    body_words, body_labels = body
    head = ["if", name, op, right_word, ":"]
    return head + body_words, [IGNORE_INDEX] * len(head) + body_labels
