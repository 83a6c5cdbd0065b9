"""Batches of fixed-length training windows cut from a token stream.

Windows do not overlap, so one epoch shows every token once as a prediction target. Batches are drawn
in a seeded order that depends only on (seed, epoch, position), which makes the stream reproducible,
resumable from two integers, and identical in content whether a global batch is computed by one process
or split across data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from blockloop.errors import BlockloopError


class PackedSequences:
    """Window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``: inputs are its first ``seq_len``
    tokens, targets its last ``seq_len``. Consecutive windows share one boundary token (the last target
    of one is the first input of the next), so the targets cover the stream exactly once, up to the end of the
    last whole window (a shorter tail is left out: every window has one shape).

    With ``start_id`` (the BOS of a model whose tokenizer starts every text with one) window ``i`` is
    ``[start_id] + tokens[i*seq_len : (i+1)*seq_len]`` instead: the model reads its BOS first, as it was
    trained to, and the targets still cover the stream exactly once (up to the last whole window)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, start_id: int | None = None, *,
                 description: str = "the data") -> None:
        if seq_len < 1:
            raise BlockloopError(f"seq_len must be at least 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.start_id = start_id
        self._count = (len(tokens) - (start_id is None)) // seq_len
        if self._count < 1:
            raise BlockloopError(
                f"{description} holds {len(tokens)} tokens, too few for one sequence of "
                f"{seq_len}{'+1' if start_id is None else ''} tokens; "
                "use a smaller --seq-len or more data"
            )

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._count:
            raise IndexError(f"sequence {i} out of range for {self._count} sequences")
        start = i * self.seq_len
        if self.start_id is not None:
            return np.concatenate([[self.start_id], self.tokens[start : start + self.seq_len]]).astype(np.int64)
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    @staticmethod
    def to_batch(windows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of stacked windows: next-token targets are the inputs shifted by one.

        Every sequence source the loaders accept has this method (labelled-position tasks pair each
        input with its own label instead, see :class:`blockloop.data.tasks.windows.TaskSequences`).
        """
        batch = torch.from_numpy(np.stack(windows))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class TrainBatches:
    """Endless, seeded, resumable stream of training batches for one data-parallel rank.

    Epoch ``e`` visits the sequences in the order ``torch.randperm`` gives with seed ``seed + e``. Each
    step consumes the next ``batch_size * world_size`` indices of that order (the global batch); rank
    ``r`` gets slice ``[r*batch_size, (r+1)*batch_size)``. Hence 2 ranks x batch 2 see exactly the
    sequences 1 rank x batch 4 sees. Indices left over at the end of an epoch that cannot fill a global
    batch are skipped (they come up at other positions in later epochs).
    """

    def __init__(
        self, sequences: PackedSequences, batch_size: int, *, seed: int, groups: int = 1, rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size < 1 or groups < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise BlockloopError(
                f"invalid batch layout: batch_size={batch_size}, groups={groups}, rank={rank}, world_size={world_size}"
            )
        # An optimizer step takes ``groups`` (gradient-accumulation) calls: fewer sequences than that would repeat
        # some within one step.
        step_batch = batch_size * world_size * groups
        if len(sequences) < step_batch:
            raise BlockloopError(
                f"the training data holds {len(sequences)} sequences of {sequences.seq_len} tokens, "
                f"fewer than one global batch of {step_batch} (batch size {batch_size} x {world_size} "
                f"ranks x {groups} accumulation steps); use a smaller --batch-size, --grad-accum or --seq-len, "
                "or more data"
            )
        self.sequences = sequences
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._epoch = 0
        self._index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.sequences), generator=generator)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 of shape ``[batch_size, seq_len]``, for this rank."""
        global_batch = self.batch_size * self.world_size
        if self._index + global_batch > len(self.sequences):
            self._epoch += 1
            self._index = 0
            self._order = self._permutation(self._epoch)
        start = self._index + self.rank * self.batch_size
        indices = self._order[start : start + self.batch_size].tolist()
        self._index += global_batch
        return self.sequences.to_batch([self.sequences[i] for i in indices])

    def state_dict(self) -> dict[str, int]:
        """Position in the stream; with the same data, seed and layout, :meth:`load_state_dict` resumes it."""
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where the saved position was; a position past the data is no place in it (next_batch would
        quietly start a new epoch, reading other text than the run would have)."""
        if int(state["index"]) > len(self.sequences):
            raise BlockloopError(
                f"the saved data position {state['index']} lies past the {len(self.sequences)} training sequences; "
                "the checkpoint is corrupt: use an earlier one")
        self._epoch = int(state["epoch"])
        self._index = int(state["index"])
        self._order = self._permutation(self._epoch)


def eval_batches(
    sequences: PackedSequences, batch_size: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) batches over the sequences in order, the last one possibly smaller.

    No shuffling, so every evaluation of the same checkpoint sees the same tokens; ``max_batches`` caps
    the cost on large validation sets by taking the first batches.
    """
    if batch_size < 1:
        raise BlockloopError(f"batch_size must be at least 1, got {batch_size}")
    count = -(-len(sequences) // batch_size)
    if max_batches is not None:
        count = min(count, max_batches)
    for b in range(count):
        stop = min((b + 1) * batch_size, len(sequences))
        yield sequences.to_batch([sequences[i] for i in range(b * batch_size, stop)])


class StreamBatches:
    """Training batches for recurrent models (truncated BPTT): row ``i`` of a step continues row ``i`` of
    the step before, so the state a model carries from one segment to the next belongs to the same text.

    The windows are dealt into ``batch_size * world_size * groups`` contiguous streams (``groups`` = the
    gradient-accumulation micro-batches, called in turn); each call returns the next window of every
    stream of this rank and group. When the streams run out they start again from their first window (a
    new epoch): :attr:`starts_streams` is then True, and the state carried so far must be dropped.
    """

    def __init__(
        self, sequences: PackedSequences, batch_size: int, *, groups: int = 1, rank: int = 0, world_size: int = 1
    ) -> None:
        if batch_size < 1 or groups < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise BlockloopError(
                f"invalid stream layout: batch_size={batch_size}, groups={groups}, rank={rank}, world_size={world_size}"
            )
        self.sequences, self.batch_size, self.groups, self.rank, self.world_size = sequences, batch_size, groups, rank, world_size
        streams = batch_size * world_size * groups
        self.stream_len = len(sequences) // streams
        if self.stream_len < 1:
            raise BlockloopError(
                f"the data holds {len(sequences)} windows of {sequences.seq_len} tokens, fewer than the {streams} "
                "parallel streams a recurrent model trains on (batch size x ranks x grad accumulation); use a "
                "smaller --batch-size or --seq-len, or more data"
            )
        self._epoch = self._offset = self._group = 0
        self.starts_streams = True

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) ``[batch_size, seq_len]``: the next window of this rank's streams in this group."""
        first = (self._group * self.world_size + self.rank) * self.batch_size
        windows = [self.sequences[(first + row) * self.stream_len + self._offset] for row in range(self.batch_size)]
        self.starts_streams = self._offset == 0
        self._group += 1
        if self._group == self.groups:
            self._group, self._offset = 0, self._offset + 1
            if self._offset == self.stream_len:
                self._epoch, self._offset = self._epoch + 1, 0
        return self.sequences.to_batch(windows)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._offset, "group": self._group,
                "streams": self.batch_size * self.world_size * self.groups, "stream_len": self.stream_len}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where the saved position was. Only in the same stream layout: a position in other streams
        would index past them, or silently read other text than the one the carried state belongs to."""
        streams = self.batch_size * self.world_size * self.groups
        saved = (int(state.get("streams", streams)), int(state.get("stream_len", self.stream_len)))
        if saved != (streams, self.stream_len) or int(state["index"]) >= self.stream_len:
            raise BlockloopError(
                f"the run's recurrent model read its data as {saved[0]} streams of {saved[1]} windows, this resume as "
                f"{streams} of {self.stream_len}; resume with the run's own --batch-size, --grad-accum, --seq-len "
                "and number of processes")
        self._epoch, self._offset, self._group = int(state["epoch"]), int(state["index"]), int(state.get("group", 0))


def stream_eval_batches(
    sequences: PackedSequences, batch_size: int, max_batches: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Evaluation batches for recurrent models: ``batch_size`` contiguous streams read side by side.

    Batch ``k`` holds window ``k`` of every stream, so a model can carry its state across batches; the
    windows left over after the last full column are not scored.
    """
    if batch_size < 1:
        raise BlockloopError(f"batch_size must be at least 1, got {batch_size}")
    streams = min(batch_size, len(sequences))
    stream_len = len(sequences) // streams
    count = stream_len if max_batches is None else min(stream_len, max_batches)
    for k in range(count):
        yield sequences.to_batch([sequences[s * stream_len + k] for s in range(streams)])
