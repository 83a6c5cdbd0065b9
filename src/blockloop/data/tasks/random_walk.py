"""The Random Walk task (Fan et al. 2020; Staircase attention, section 4.1): track an agent on a grid.

An agent on an 8x8 grid starts every sequence in cell (row 4, column 4), facing north (towards row 0).
It then takes 400 actions, each uniform among ``L`` (turn left), ``R`` (turn right) and ``F`` (move one
cell forward); a move that would leave the grid leaves the agent where it is. After every action the
model must output the agent's cell, one label word per cell: ``r<row>c<col>``. A sequence ends with an
unlabelled ``END``, and the next one starts afresh from the same cell and heading.

Neither paper states the grid size in its text; 8x8 is our choice: big enough that the position cannot
be guessed (64 cells), small enough that walls are met often (about one forward move in five is
blocked), so blocked moves matter. The fixed start means the actions alone determine every label.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from blockloop.data.tasks.base import IGNORE_INDEX, GenerateFn, TaskStream, TaskVocab

GRID_SIZE = 8
ACTIONS_PER_SEQUENCE = 400
START = (GRID_SIZE // 2, GRID_SIZE // 2)
ACTIONS = ("L", "R", "F")
# Headings clockwise from north, as (row, column) steps; L is one step anticlockwise, R one clockwise.
_STEPS = np.array([(-1, 0), (0, 1), (1, 0), (0, -1)])
# Sequences simulated together: bounds memory whatever the split size, and paces the progress bar.
_CHUNK = 1024

VOCAB = TaskVocab(
    ["END", *ACTIONS, *(f"r{row}c{col}" for row in range(GRID_SIZE) for col in range(GRID_SIZE))]
)


def generator(length: int = ACTIONS_PER_SEQUENCE) -> GenerateFn:
    """The generator of walks of ``length`` actions (default 400, the paper's; shorter only for CPU-sized runs)."""

    def generate(count: int, seed: int, advance: Callable[[int], None]) -> TaskStream:
        return _generate(count, seed, advance, length)

    return generate


def _generate(count: int, seed: int, advance: Callable[[int], None], length: int) -> TaskStream:
    """``count`` sequences of ``length`` actions plus ``END``, concatenated.

    ``seed`` seeds one numpy ``Generator`` that draws all actions, in chunks of 1024 sequences.
    """
    rng = np.random.default_rng(seed)
    width = length + 1
    inputs = np.empty((count, width), dtype=np.uint16)
    labels = np.empty((count, width), dtype=np.int16)
    action_ids = np.array([VOCAB.id(a) for a in ACTIONS], dtype=np.uint16)
    first_cell = VOCAB.id("r0c0")
    for start in range(0, count, _CHUNK):
        actions = rng.integers(0, len(ACTIONS), size=(min(_CHUNK, count - start), length))
        rows = slice(start, start + len(actions))
        inputs[rows, :-1] = action_ids[actions]
        inputs[rows, -1] = VOCAB.id("END")
        labels[rows, :-1] = first_cell + _walk(actions)
        labels[rows, -1] = IGNORE_INDEX
        advance(len(actions))
    return TaskStream(inputs=inputs.reshape(-1), labels=labels.reshape(-1))


def _walk(actions: np.ndarray) -> np.ndarray:
    """Cell index (row * GRID_SIZE + col) after each action, for a batch of sequences of ACTIONS indices."""
    n, length = actions.shape
    row = np.full(n, START[0])
    col = np.full(n, START[1])
    heading = np.zeros(n, dtype=np.int64)
    cells = np.empty((n, length), dtype=np.int64)
    for t in range(length):
        action = actions[:, t]
        heading = (heading + (action == ACTIONS.index("R")) - (action == ACTIONS.index("L"))) % 4
        forward = action == ACTIONS.index("F")
        new_row = row + forward * _STEPS[heading, 0]
        new_col = col + forward * _STEPS[heading, 1]
        inside = (new_row >= 0) & (new_row < GRID_SIZE) & (new_col >= 0) & (new_col < GRID_SIZE)
        row = np.where(inside, new_row, row)
        col = np.where(inside, new_col, col)
        cells[:, t] = row * GRID_SIZE + col
    return cells
