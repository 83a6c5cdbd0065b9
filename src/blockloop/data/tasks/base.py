"""What every state-tracking task shares: a closed vocabulary, the split names and per-split seeding.

A task is a stream of input tokens with an aligned stream of labels: the label at position ``i`` is what
the model must output after reading input ``i`` (not the next input), or :data:`IGNORE_INDEX` where
nothing is asked. Inputs and labels share one vocabulary, so a single output head over ``vocab_size``
ids serves both the task and, if wanted, next-token prediction of the inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from blockloop.nn.loss import IGNORE_INDEX

# The word shown for an unlabelled position when labels are written out as text.
NO_LABEL = "_"
SPLITS = ("train", "valid", "test")


class TaskVocab:
    """The closed word list of one task: word <-> id, with ``_`` (the no-label marker) always id 0.

    Words are separated by single spaces in text form, so ``encode("x = 3 ;")`` gives four ids.
    """

    def __init__(self, words: Sequence[str]) -> None:
        self.words = (NO_LABEL, *words)
        if len(set(self.words)) != len(self.words):
            raise ValueError(f"vocabulary has repeated words: {self.words}")
        self._ids = {word: i for i, word in enumerate(self.words)}
        self.vocab_size = len(self.words)

    def id(self, word: str) -> int:
        return self._ids[word]

    def encode(self, text: str) -> list[int]:
        return [self._ids[word] for word in text.split()]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; :data:`IGNORE_INDEX` (an unlabelled position) reads as ``_``."""
        return " ".join(self.words[0 if i == IGNORE_INDEX else int(i)] for i in ids)


@dataclass(frozen=True)
class TaskStream:
    """One split: input ids and the aligned labels (``IGNORE_INDEX`` where nothing is asked)."""

    inputs: np.ndarray
    labels: np.ndarray


# generate(count, seed, advance) -> the stream of `count` programs/sequences; advance(n) reports progress.
GenerateFn = Callable[[int, int, Callable[[int], None]], TaskStream]


@dataclass(frozen=True)
class Task:
    """A registered task: how to generate it, its vocabulary and the default split sizes (in sequences)."""

    name: str
    description: str
    vocab: TaskVocab
    generate: GenerateFn
    default_sizes: tuple[int, int, int]
    # Facts about the task recorded in meta.json so a written dataset describes itself.
    details: dict[str, object]
    # The fewest tokens one sequence takes, its END included: a model whose context is shorter cannot read one,
    # which is known before the task is generated (NAME:N variants can take hours and gigabytes to write).
    min_tokens: int = 1


def split_seed(seed: int, split: str) -> int:
    """The seed one split is generated from, derived from the user's ``seed`` and the split's name.

    Each split has its own random stream, so changing how many training programs are made leaves the
    validation and test sets unchanged, and the three splits never share draws.
    """
    state = np.random.SeedSequence([seed, SPLITS.index(split)]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])
