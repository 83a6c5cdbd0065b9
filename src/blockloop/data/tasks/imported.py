"""Your own state-tracking data as a task directory: ``blockloop tasks import DATA.jsonl --out DIR``.

The input is JSON lines, one sequence per line::

    {"tokens": ["x", "=", "3", ";", "print", "x", ";"], "labels": [null, null, null, null, null, null, "3"]}

``labels`` has one entry per token: the word the model must output after reading that token, or ``null``
where nothing is asked. Words are strings (numbers are read as their decimal text) without spaces, since a
task's text form separates words by spaces. Each sequence gets an unlabelled ``END`` after it, exactly as
the built-in tasks, so the result is a task directory that ``train --task-dir`` and ``eval --task-dir`` read
like one written by ``tasks make``; ``_`` and ``END`` are therefore reserved.

The splits are either given (``train``, ``valid`` and ``test`` files) or drawn from one file: a seeded
permutation picks which sequences go to valid and test (the same seed and file always give the same
split), and each split keeps the file's order. The vocabulary is ``END`` then every other word of the
data in sorted order, or, with ``vocab_from``, the vocabulary of an earlier import (so new evaluation data
keeps the ids a model was trained with); a word outside it is refused with its file and line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from blockloop.data.tasks.base import IGNORE_INDEX, NO_LABEL, SPLITS, TaskStream, TaskVocab
from blockloop.data.tasks.files import load_task, write_splits
from blockloop.data.tasks.registry import TASKS
from blockloop.errors import BlockloopError, utf8_problem
from blockloop.files import check_new_folder

END = "END"
# Ids are stored as uint16 inputs and int16 labels.
MAX_VOCAB = np.iinfo(np.int16).max
# One sequence: its words and one label word (or None) per word, with the line it came from.
ParsedSequence = tuple[list[str], list[str | None], int]


def read_sequences(path: Path) -> list[ParsedSequence]:
    """The sequences of one JSON-lines file; blank lines are skipped, anything malformed names its line."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "is not a file" if path.exists() else "does not exist"
        raise BlockloopError(f"{path} {what}; give a .jsonl file with one sequence per line")
    sequences = []
    with path.open("rb") as handle:  # decoded line by line, so a byte that is not UTF-8 is named by its line
        for number, raw in enumerate(handle, start=1):
            try:  # a byte-order mark, as some editors write first, is not part of the JSON
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise BlockloopError(f"{path}:{number}: not UTF-8 text (byte {exc.start} of the line); "
                                     "save the file as UTF-8") from None
            if line.strip():
                sequences.append(_parse_line(path, number, line))
    if not sequences:
        raise BlockloopError(f"{path} holds no sequences (it is empty); write one JSON object per line")
    return sequences


def _parse_line(path: Path, number: int, line: str) -> ParsedSequence:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BlockloopError(f"{where}: not valid JSON ({exc.msg}); write one JSON object per line") from None
    if not isinstance(record, dict) or not isinstance(record.get("tokens"), list) or not isinstance(record.get("labels"), list):
        raise BlockloopError(f'{where}: expected an object {{"tokens": [...], "labels": [...]}}')
    tokens, labels = record["tokens"], record["labels"]
    if not tokens:
        raise BlockloopError(f"{where}: the sequence has no tokens")
    if len(tokens) != len(labels):
        raise BlockloopError(
            f"{where}: {len(tokens)} tokens but {len(labels)} labels; give one label per token (null where nothing is asked)"
        )
    words = [_word(where, token, "token") for token in tokens]
    return words, [None if label is None else _word(where, label, "label") for label in labels], number


def _word(where: str, value: object, kind: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BlockloopError(f"{where}: {kind} {json.dumps(value)} is not a string or a whole number")
    word = str(value)
    problem = utf8_problem(word)  # JSON can escape a lone surrogate, which no output can print
    if problem is not None:
        raise BlockloopError(f"{where}: {kind} {json.dumps(value)} {problem}; write it in UTF-8")
    if not word or any(char.isspace() for char in word):
        raise BlockloopError(f"{where}: {kind} {json.dumps(value)} is empty or holds whitespace; words are space-separated")
    if word in (NO_LABEL, END):
        raise BlockloopError(f"{where}: {kind} {word!r} is reserved ({NO_LABEL} = no label, {END} = end of sequence); rename it")
    return word


def split_sequences(
    sequences: list[ParsedSequence], *, seed: int, valid_fraction: float, test_fraction: float, source: Path
) -> dict[str, list[ParsedSequence]]:
    """Train/valid/test from one file: ``round(n * fraction)`` sequences (at least one) to valid and to test,
    chosen by a permutation seeded with ``seed``; the rest train. Each split keeps the file's order."""
    for name, fraction in (("--valid-fraction", valid_fraction), ("--test-fraction", test_fraction)):
        if not 0.0 < fraction < 1.0:
            raise BlockloopError(f"{name} must be between 0 and 1 (exclusive), got {fraction}")
    if valid_fraction + test_fraction >= 1.0:
        raise BlockloopError(f"--valid-fraction {valid_fraction:g} and --test-fraction {test_fraction:g} leave nothing to "
                             "train on; keep their sum below 1")
    n = len(sequences)
    n_valid, n_test = (max(1, round(n * fraction)) for fraction in (valid_fraction, test_fraction))
    if n - n_valid - n_test < 1:
        raise BlockloopError(
            f"{source} holds {n} sequences: valid takes {n_valid} (--valid-fraction {valid_fraction:g}) and test "
            f"{n_test} (--test-fraction {test_fraction:g}), leaving none to train on; lower the fractions, add "
            "sequences or give --valid and --test files"
        )
    order = np.random.default_rng(seed).permutation(n)
    chosen = {"valid": order[:n_valid], "test": order[n_valid : n_valid + n_test], "train": order[n_valid + n_test :]}
    return {split: [sequences[i] for i in sorted(chosen[split])] for split in SPLITS}


def build_vocab(splits: Mapping[str, list[ParsedSequence]]) -> TaskVocab:
    """``END``, then every word of the data (tokens and labels) in sorted order."""
    words = {word for sequences in splits.values() for tokens, labels, _ in sequences for word in tokens}
    words |= {label for sequences in splits.values() for _, labels, _ in sequences for label in labels if label is not None}
    if len(words) + 2 > MAX_VOCAB:
        raise BlockloopError(f"the data has {len(words)} distinct words; a task holds at most {MAX_VOCAB - 2}")
    return TaskVocab([END, *sorted(words)])


def encode(sequences: list[ParsedSequence], vocab: TaskVocab, source: Path, split: str) -> TaskStream:
    """One split's stream: the sequences in order, each followed by an unlabelled ``END``."""
    inputs: list[int] = []
    labels: list[int] = []
    for tokens, answers, number in sequences:
        try:
            inputs += [vocab.id(word) for word in tokens]
            labels += [IGNORE_INDEX if word is None else vocab.id(word) for word in answers]
        except KeyError as exc:
            raise BlockloopError(
                f"{source}:{number}: {exc.args[0]!r} is not in the vocabulary given with --vocab-from; "
                "import with the training data's vocabulary only data made of its words"
            ) from None
        inputs.append(vocab.id(END))
        labels.append(IGNORE_INDEX)
    stream = TaskStream(inputs=np.array(inputs, dtype=np.uint16), labels=np.array(labels, dtype=np.int16))
    if not (stream.labels != IGNORE_INDEX).any():
        raise BlockloopError(f"the {split} split ({source}) has no labelled positions; label at least one token")
    return stream


def import_task(
    data: Path | str,
    out_dir: Path | str,
    *,
    name: str | None = None,
    valid: Path | str | None = None,
    test: Path | str | None = None,
    seed: int | None = None,
    valid_fraction: float | None = None,
    test_fraction: float | None = None,
    vocab_from: Path | str | None = None,
) -> Path:
    """Write the sequences of ``data`` (JSON lines, see the module docstring) as a task directory ``out_dir``.

    With ``valid`` and ``test`` files, ``data`` is the train split; without them the three splits are drawn
    from ``data`` by :func:`split_sequences` with ``seed`` (default 0) and the fractions (default 0.1 each),
    which are refused next to the files rather than ignored. ``name`` (default: the directory's name) is what
    runs record; it may not be a built-in task's. ``vocab_from`` reuses the vocabulary of a task directory.
    """
    out_dir = check_new_folder(out_dir)
    name = name or out_dir.name
    problem = ("is empty" if not name else "holds whitespace" if any(char.isspace() for char in name)
               else f"is the built-in task {name.partition(':')[0]}'s" if name.partition(":")[0] in TASKS else None)
    if problem:
        raise BlockloopError(f"task name {name!r} {problem}; choose another with --name")
    if (valid is None) != (test is None):
        raise BlockloopError("give both --valid and --test files (DATA is then the train split), or neither")
    drawing = {"--seed": seed, "--valid-fraction": valid_fraction, "--test-fraction": test_fraction}
    if valid is not None and any(value is not None for value in drawing.values()):
        given = " and ".join(flag for flag, value in drawing.items() if value is not None)
        verb = "draws" if " and " not in given else "draw"
        raise BlockloopError(f"{given} {verb} the splits from DATA, but --valid and --test give them; drop one or the other")
    seed = 0 if seed is None else seed
    valid_fraction = 0.1 if valid_fraction is None else valid_fraction
    test_fraction = 0.1 if test_fraction is None else test_fraction
    if seed < 0:
        raise BlockloopError(f"seed must be zero or positive, got {seed}")
    data = Path(data)
    if valid is None:
        files = {split: data for split in SPLITS}
        splits = split_sequences(read_sequences(data), seed=seed, valid_fraction=valid_fraction,
                                 test_fraction=test_fraction, source=data)
    else:
        files = {"train": data, "valid": Path(valid), "test": Path(test)}
        splits = {split: read_sequences(path) for split, path in files.items()}
    vocab = load_task(Path(vocab_from)).vocab if vocab_from is not None else build_vocab(splits)
    streams = {split: encode(sequences, vocab, files[split], split) for split, sequences in splits.items()}
    longest = max(len(tokens) + 1 for sequences in splits.values() for tokens, _, _ in sequences)
    meta = {
        "task": name,
        "description": f"imported from {', '.join(sorted({str(path) for path in files.values()}))}",
        "seed": seed,
        "sizes": {split: len(sequences) for split, sequences in splits.items()},
        "details": {
            "source": "import",
            "files": {split: str(path.resolve()) for split, path in files.items()},
            "split": "given files" if valid is not None else {"valid_fraction": valid_fraction, "test_fraction": test_fraction},
            "vocab_from": str(Path(vocab_from).resolve()) if vocab_from is not None else None,
            "longest_sequence": longest,
            "unit": "sequence",
        },
    }
    return write_splits(out_dir, streams, vocab, meta)
