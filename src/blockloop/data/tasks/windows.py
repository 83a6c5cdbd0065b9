"""Training and evaluation windows over a task stream, each label scored once with its whole history.

Unlike a text corpus, a task stream cannot be cut anywhere: a label depends on everything since the
start of its program or walk, so a window that began mid-sequence would ask questions its inputs cannot
answer. Windows therefore start at a sequence start (the token after an ``END``) and are ``seq_len``
tokens long; the next window starts at the last sequence start inside the previous one, and its labels
that the previous window already scored become ``IGNORE_INDEX``. Every labelled position is thus scored exactly
once, in a window that holds its sequence from the beginning. (The last window ends at the end of the
stream; it may start before a sequence start but still holds the whole of every sequence it scores.)

With walks of fixed length and ``seq_len`` a multiple of the walk plus its ``END``, windows simply tile
the stream. A sequence longer than ``seq_len`` cannot be scored whole and is refused.
"""

from __future__ import annotations

import numpy as np
import torch

from blockloop.data.tasks.base import IGNORE_INDEX, TaskStream
from blockloop.errors import BlockloopError


class TaskSequences:
    """Window ``i``: inputs and labels of ``stream[start_i : start_i + seq_len]``, already-scored labels masked.

    A drop-in source for :class:`~blockloop.data.loader.TrainBatches` and
    :func:`~blockloop.data.loader.eval_batches`: ``to_batch`` gives ``(inputs, labels)`` where the label
    at position ``t`` is the answer after reading inputs ``0..t`` (no shift), ``IGNORE_INDEX`` where nothing is asked.
    """

    # Tells the trainer and `eval` to report the task error beside the loss.
    labelled_positions = True
    # Windows overlap and each holds its scored sequences whole (the paper's tasks are independent
    # sequences, section 4.1), so recurrent models read each window once from an empty state instead of
    # carrying state from one window to the next, which would re-read the overlap after the state saw it.
    independent_windows = True

    def __init__(self, stream: TaskStream, seq_len: int, *, end_id: int, description: str = "task split",
                 unit: int = 1) -> None:
        """``unit``: what the model's ``--seq-len`` must be a multiple of, so that a window too short for a sequence
        names a length the model can take (a staircase's chunk), not one it refuses next."""
        if seq_len < 1:
            raise BlockloopError(f"seq_len must be at least 1, got {seq_len}")
        self.stream, self.seq_len = stream, seq_len
        total = len(stream.inputs)
        if total < seq_len:
            raise BlockloopError(
                f"{description} holds {total} tokens, fewer than one window of --seq-len {seq_len}; "
                "lower --seq-len or generate more sequences"
            )
        if not (np.asarray(stream.labels) != IGNORE_INDEX).any():
            raise BlockloopError(f"{description} has no labelled positions to learn or score; regenerate the dataset")
        starts = np.concatenate([[0], np.flatnonzero(np.asarray(stream.inputs) == end_id) + 1])
        starts = starts[starts < total]
        longest = int(np.diff(np.append(starts, total)).max())
        if longest > seq_len:
            fits = -(-longest // unit) * unit
            raise BlockloopError(
                f"{description} has a sequence of {longest} tokens, longer than --seq-len {seq_len}; raise --seq-len "
                f"to at least {fits} (past the model's context, a new run also needs --set context_length={fits} or "
                "more) or use shorter sequences (NAME:LENGTH)"
            )
        self.starts, self.first_scored = _windows(starts, total, seq_len)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> np.ndarray:
        """``(2, seq_len)`` int64: row 0 the inputs, row 1 the labels (``IGNORE_INDEX`` before the first scored
        position)."""
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = int(self.starts[i])
        window = np.stack(
            [
                np.asarray(self.stream.inputs[start : start + self.seq_len], dtype=np.int64),
                np.asarray(self.stream.labels[start : start + self.seq_len], dtype=np.int64),
            ]
        )
        window[1, : self.first_scored[i]] = IGNORE_INDEX
        return window

    @staticmethod
    def to_batch(windows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.from_numpy(np.stack(windows))
        return batch[:, 0].contiguous(), batch[:, 1].contiguous()


def _windows(starts: np.ndarray, total: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(window starts, offset of each window's first scored position) as described in the module docstring.

    Each step moves to the last sequence start at or before the previous window's end; that start lies
    past the previous window's own start because no sequence is longer than ``seq_len``.
    """
    window_starts, first_scored = [0], [0]
    start = 0
    while start + seq_len < total:
        end = start + seq_len
        following = int(starts[np.searchsorted(starts, end, side="right") - 1])
        start = min(following, total - seq_len)
        window_starts.append(start)
        first_scored.append(end - start)
    return np.array(window_starts, dtype=np.int64), np.array(first_scored, dtype=np.int64)
