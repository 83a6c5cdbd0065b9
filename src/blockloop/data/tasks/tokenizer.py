"""A task's closed vocabulary behind the :class:`~blockloop.data.tokenizers.Tokenizer` interface.

A model trained on a task must be saved and reloaded with the ids it was trained on, exactly as one
trained on text is, so the task vocabulary becomes a tokenizer: ids are the :class:`TaskVocab` ids
(``_`` = 0, then the task's words), ``END`` doubles as end-of-text, and ``tokenizer.json`` holds the
word list itself, so a checkpoint needs nothing else to rebuild it. This module registers that saved form
with :func:`~blockloop.data.tokenizers.load_tokenizer`; the checkpoint loader (:mod:`blockloop.train.run`)
imports the task package, so the registration is in place wherever checkpoints are loaded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from blockloop.data.tasks.base import TaskVocab
from blockloop.data.tokenizers import Tokenizer, register_saved_type
from blockloop.errors import BlockloopError
from blockloop.files import atomic_write_text

SAVED_TYPE = "blockloop-task"


SHOWN_WORDS = 40  # of a task's vocabulary, in the error for a word outside it


class TaskTokenizer(Tokenizer):
    """Words of one task <-> ids; text is the task's words separated by spaces (``"L F R"``)."""

    def __init__(self, task: str, vocab: TaskVocab) -> None:
        self.task = task
        self.vocab = vocab
        self.name = f"task:{task}"
        self.vocab_size = vocab.vocab_size
        self.eos_id = vocab.id("END")

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            raise BlockloopError(f"tokenizer {self.name!r} reads the task's words, not raw bytes")
        try:
            return self.vocab.encode(text)
        except KeyError as exc:
            words = self.vocab.words
            # an imported task may have thousands: the first few show their form, a line of 29 KB shows nothing
            shown = " ".join(words) if len(words) <= SHOWN_WORDS else (
                f"{' '.join(words[:SHOWN_WORDS])} ... ({len(words)} in all)")
            raise BlockloopError(f"{exc.args[0]!r} is not a word of task {self.task}; its words: {shown}") from None

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [np.array(self.encode(text), dtype=np.uint16) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self.vocab.decode(i for i in ids if 0 <= i < self.vocab_size)

    def token_byte_lengths(self) -> np.ndarray:
        """All zero: task symbols stand for no text, so bits per byte is not defined for them."""
        return np.zeros(self.vocab_size, dtype=np.int64)

    def save(self, directory: Path) -> None:
        payload = {"type": SAVED_TYPE, "version": 1, "task": self.task, "words": list(self.vocab.words[1:])}
        atomic_write_text(Path(directory) / "tokenizer.json", json.dumps(payload))

    def fingerprint(self) -> str:
        return "blockloop-task-v1:" + " ".join(self.vocab.words)

    @classmethod
    def from_saved(cls, data: dict[str, object]) -> TaskTokenizer:
        """The tokenizer a :meth:`save` wrote, from the parsed ``tokenizer.json``."""
        try:
            return cls(str(data["task"]), TaskVocab([str(word) for word in data["words"]]))  # type: ignore[union-attr]
        except (KeyError, TypeError, ValueError) as exc:
            raise BlockloopError(f"tokenizer.json of a task model is corrupt ({exc!r}); restore it or retrain") from None

    def same_vocabulary(self, vocab: TaskVocab) -> bool:
        return self.vocab.words == vocab.words


register_saved_type(SAVED_TYPE, TaskTokenizer.from_saved)


def refuse_text(tokenizer: Tokenizer, fix: str) -> None:
    """A model that learned a task reads that task's words, not text: say so, rather than name the first word of
    the text that is not one of them."""
    if isinstance(tokenizer, TaskTokenizer):
        raise BlockloopError(f"the model learned task {tokenizer.task} and reads its words, not text; {fix}")


def answer_length(tokenizer: Tokenizer, asked: int | None, flag: str) -> int | None:
    """How many tokens to generate: ``asked`` for a model of text; for a task's model one, its label after the last
    word (a label fed back is no word it reads, so what would follow is noise), and more than one is refused
    naming ``flag``."""
    if not isinstance(tokenizer, TaskTokenizer):
        return asked
    if asked not in (None, 1):
        raise BlockloopError(f"this model learned task {tokenizer.task}: it answers a sequence of the task's words "
                             f"with one label, the state after the last word; ask for {flag} 1, or leave it out (a "
                             "label fed back is no word it reads)")
    return 1

