"""Task datasets on disk: three splits of memory-mappable arrays and a ``meta.json`` that describes them.

Layout of a task directory::

    meta.json                      # format, task, seed, sizes, vocabulary, token counts, dtypes
    train/inputs.bin  train/labels.bin
    valid/inputs.bin  valid/labels.bin
    test/inputs.bin   test/labels.bin

``inputs.bin`` holds uint16 ids and ``labels.bin`` int16 ids or ``IGNORE_INDEX`` = -100 (unlabelled), one per input, raw
little-endian with no header, so ``np.memmap`` reads them without copying. The whole directory is
written under a temporary name next to the target and renamed into place last, so a killed run never
leaves a half-written dataset under the real name.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockloop import progress
from blockloop.data.packages import cache_dir
from blockloop.data.tasks.base import IGNORE_INDEX, NO_LABEL, SPLITS, Task, TaskStream, TaskVocab, split_seed
from blockloop.data.tasks.registry import get_task
from blockloop.errors import BlockloopError
from blockloop.files import check_new_folder, folder_in_place

# Bump when the layout or the generators change, so datasets made by another version are refused.
FORMAT = 1
_DTYPES = {"inputs": "<u2", "labels": "<i2"}


@dataclass(frozen=True)
class TaskData:
    """A task read back from disk: its vocabulary, ``meta.json`` and the three splits (read-only maps)."""

    name: str
    vocab: TaskVocab
    meta: dict[str, object]
    splits: dict[str, TaskStream]


def generate_splits(
    task: Task, *, seed: int, sizes: Sequence[int], progress: Callable[[int], None] = lambda n: None
) -> dict[str, TaskStream]:
    """The train/valid/test streams of ``task`` with ``sizes`` sequences each, from ``seed``.

    Each split draws from its own seed (:func:`split_seed`), so a split depends only on ``seed``, its
    name and its own size.
    """
    need = sum(sizes) * task.min_tokens * 4  # a uint16 input and an int16 label per token, at the least
    too_big = BlockloopError(
        f"task {task.name} at sizes {'/'.join(map(str, sizes))} needs at least {need / 2**30:,.1f} GiB of memory, "
        f"more than this machine has; use smaller sizes or shorter sequences ({task.name.partition(':')[0]}:N)")
    if need > physical_memory():  # refused now: the generators would fill memory for hours before failing
        raise too_big
    try:
        return {split: task.generate(size, split_seed(seed, split), progress) for split, size in zip(SPLITS, sizes)}
    except MemoryError:  # numpy refuses an array it cannot allocate before writing any of it
        raise too_big from None


def physical_memory() -> float:
    """This machine's memory in bytes (infinite where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return math.inf


def write_task(
    name: str, out_dir: Path, *, seed: int, sizes: Sequence[int] | None = None, show_progress: bool = False
) -> Path:
    """Generate task ``name`` and write it to ``out_dir``, which must not exist or be empty; returns ``out_dir``.

    ``sizes`` (train, valid, test) counts programs or sequences; default: the task's own. A progress
    bar appears when ``show_progress`` and generation takes more than a second.
    """
    task = get_task(name)
    sizes = tuple(task.default_sizes if sizes is None else sizes)
    if len(sizes) != len(SPLITS) or any(size < 1 for size in sizes):
        raise BlockloopError(f"sizes must be three positive counts (train, valid, test), got {list(sizes)}")
    if seed < 0:
        raise BlockloopError(f"seed must be zero or positive, got {seed}")
    out_dir = check_new_folder(out_dir)
    bar = progress.bar(total=sum(sizes), desc=f"generating {task.name}", unit="seq", delay=1.0, disable=not show_progress)
    with bar:
        streams = generate_splits(task, seed=seed, sizes=sizes, progress=bar.update)
    for split, stream in streams.items():  # a split that asks nothing would train and score on nothing
        if not (stream.labels != IGNORE_INDEX).any():
            raise BlockloopError(f"task {task.name} (seed {seed}) drew no labelled position in its {split} split of "
                                 f"{sizes[SPLITS.index(split)]}; give longer sequences ({task.name.partition(':')[0]}:N) "
                                 "or larger --sizes")
    meta = {"task": task.name, "description": task.description, "seed": seed, "sizes": dict(zip(SPLITS, sizes)),
            "details": task.details}
    return write_splits(out_dir, streams, task.vocab, meta)


def write_splits(out_dir: Path, streams: dict[str, TaskStream], vocab: TaskVocab, meta: dict[str, object]) -> Path:
    """Write ``streams`` and ``meta.json`` (``meta`` plus the format, vocabulary, token counts and dtypes) into
    ``out_dir`` all at once (:func:`blockloop.files.folder_in_place`)."""
    meta = {"format": FORMAT, **meta, "tokens": {split: len(stream.inputs) for split, stream in streams.items()},
            "vocab": list(vocab.words), "ignore_index": IGNORE_INDEX, "dtypes": _DTYPES}
    with folder_in_place(out_dir) as tmp:
        for split, stream in streams.items():
            (tmp / split).mkdir()
            stream.inputs.astype(_DTYPES["inputs"]).tofile(tmp / split / "inputs.bin")
            stream.labels.astype(_DTYPES["labels"]).tofile(tmp / split / "labels.bin")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out_dir


def load_task(directory: Path) -> TaskData:
    """Read a directory written by :func:`write_task`; the arrays are memory-mapped, not loaded.

    Missing files, unreadable or foreign ``meta.json`` and arrays of the wrong length (truncated or
    overwritten files) raise :class:`BlockloopError` naming the problem.
    """
    directory = Path(directory)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise BlockloopError(
            f"{directory} is not a task dataset (no meta.json); write one with `blockloop tasks make`"
        )
    malformed = (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, IndexError)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        version = meta["format"]
    except malformed as exc:
        raise BlockloopError(f"{meta_path} is corrupt ({exc}); regenerate the dataset") from exc
    if version != FORMAT:
        raise BlockloopError(
            f"{directory} has task format {version}, this blockloop reads format {FORMAT}; regenerate the dataset"
        )
    try:
        name = str(meta["task"])
        tokens = {split: int(meta["tokens"][split]) for split in SPLITS}
        if meta["vocab"][0] != NO_LABEL:
            raise ValueError(f"the vocabulary does not start with {NO_LABEL!r}")
        vocab = TaskVocab(meta["vocab"][1:])
    except malformed as exc:
        raise BlockloopError(f"{meta_path} is corrupt ({exc}); regenerate the dataset") from exc
    splits = {}
    for split in SPLITS:
        arrays = {}
        for kind, dtype in _DTYPES.items():
            path = directory / split / f"{kind}.bin"
            expected = tokens[split] * np.dtype(dtype).itemsize
            if not path.is_file():
                raise BlockloopError(f"{path} is missing; regenerate the dataset")
            if path.stat().st_size != expected:
                raise BlockloopError(
                    f"{path} has {path.stat().st_size} bytes, expected {expected}: truncated or corrupt; "
                    "regenerate the dataset"
                )
            arrays[kind] = np.memmap(path, dtype=dtype, mode="r", shape=(tokens[split],))
            # Ids past the vocabulary would fail deep inside the model's embedding or loss: say which file.
            ids = arrays[kind][arrays[kind] != IGNORE_INDEX] if kind == "labels" else arrays[kind]
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab.vocab_size):
                raise BlockloopError(f"{path} holds ids outside the task's {vocab.vocab_size}-word vocabulary: "
                                     "corrupt; regenerate the dataset")
        splits[split] = TaskStream(**arrays)
    return TaskData(name=name, vocab=vocab, meta=meta, splits=splits)


def open_task(
    name: str | None, directory: Path | str | None = None, *, show_progress: bool = False, context: int | None = None
) -> TaskData:
    """The task to train or evaluate on: read from ``directory``, or generated once into the cache.

    Without a directory the task is generated with seed 0 and its default sizes under
    ``<cache>/tasks/`` (the same files on every machine, so runs that name only the task agree); later
    calls just map them. With a directory, ``name`` (if given) must be the task it holds. ``context``, the model's,
    refuses a built-in task whose every sequence is longer, before it is generated.
    """
    if directory is None:
        if name is None:
            raise BlockloopError("name a task (--task) or a task directory (--task-dir)")
        task = get_task(name)  # an unknown name fails before any work
        if context is not None and task.min_tokens > context:
            raise BlockloopError(
                f"every sequence of task {task.name} takes at least {task.min_tokens} tokens, more than the model "
                f"context of {context}; use shorter sequences ({task.name.partition(':')[0]}:N) or a model with a "
                "longer context"
            )
        directory = cache_dir() / "tasks" / f"{task.name.replace(':', '-len')}-seed0-format{FORMAT}"
        if not (directory / "meta.json").is_file():
            try:
                write_task(task.name, directory, seed=0, show_progress=show_progress)
            except BlockloopError:
                if not (directory / "meta.json").is_file():  # not a concurrent writer finishing first
                    raise
    data = load_task(Path(directory))
    if name is not None and data.name != name:
        raise BlockloopError(f"{directory} holds task {data.name}, not {name}; drop --task or point --task-dir elsewhere")
    return data
