"""The hypothetical generation speedup of continuous depth-wise batching (Bae et al. 2024, section 3.8 and
appendix N): given each request's exit trajectory (the loop every decoded token leaves after, e.g. the
oracle exits :class:`~blockloop.serve.runners.recursive.RecursiveRunner` records), count the steps a batch of
``n_slots`` rows needs under each schedule. One step is one pass of the shared block over the batch, the
unit whose time the paper measures (only Transformer-block time is counted, as in appendix N).

* depth-wise: every row runs one loop per step; a token leaves after its exit loop and the row starts the
  next token (or, when its request is done, the next queued request) at the very next step;
* sequence-wise (continuous): every token runs all ``loops`` loops, so the rows move in lock-step and a
  finished request's row is refilled at the next token boundary; early exits save nothing, since an
  exited token would wait for the batch anyway (the synchronisation problem of section 2.4);
* static (no continuous batching, the paper's plain vanilla baseline): batches of ``n_slots`` requests
  run until their longest request is done.

Requests arrive as one fixed queue (the paper's simplification, appendix G) and are served first come,
first served. Only decode steps are counted: the prompt and the first generated token come from the
(sequence-wise) prefill in every schedule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from blockloop.errors import BlockloopError


def _check(trajectories: Sequence[Sequence[int]], n_slots: int, loops: int) -> None:
    if n_slots < 1 or loops < 1:
        raise BlockloopError(f"the schedule needs n_slots >= 1 and loops >= 1, got {n_slots} and {loops}")
    for trajectory in trajectories:
        if any(not 1 <= k <= loops for k in trajectory):
            raise BlockloopError(f"exit loops must lie in 1..{loops}, got {list(trajectory)}")


def depthwise_steps(trajectories: Sequence[Sequence[int]], n_slots: int, loops: int) -> int:
    """Steps of continuous depth-wise batching for these exit trajectories (one list of exit loops per request)."""
    _check(trajectories, n_slots, loops)
    queue = deque(list(t) for t in trajectories if t)
    rows: list[list[int]] = []  # per busy row: its request's exit loops still to run, the first in flight
    done: list[int] = []  # loops the in-flight token of each row has run
    steps = 0
    while queue or rows:
        while queue and len(rows) < n_slots:
            rows.append(queue.popleft())
            done.append(0)
        steps += 1
        for i in range(len(rows)):
            done[i] += 1
            if done[i] == rows[i][0]:
                rows[i].pop(0)
                done[i] = 0
        keep = [i for i, r in enumerate(rows) if r]
        rows, done = [rows[i] for i in keep], [done[i] for i in keep]
    return steps


def sequencewise_steps(trajectories: Sequence[Sequence[int]], n_slots: int, loops: int) -> int:
    """Steps of continuous sequence-wise batching: every token runs all loops, whatever its exit."""
    return depthwise_steps([[loops] * len(t) for t in trajectories], n_slots, loops)


def static_steps(trajectories: Sequence[Sequence[int]], n_slots: int, loops: int) -> int:
    """Steps of static batching: each batch of ``n_slots`` requests runs all loops until its longest is done."""
    _check(trajectories, n_slots, loops)
    lengths = [len(t) for t in trajectories if t]
    return sum(loops * max(lengths[i : i + n_slots]) for i in range(0, len(lengths), n_slots))


def simulate(trajectories: Sequence[Sequence[int]], n_slots: int, loops: int) -> dict[str, float]:
    """Mean exit loop, the steps of each schedule, and the depth-wise speedups over the other two."""
    tokens = sum(len(t) for t in trajectories)
    if tokens == 0:
        raise BlockloopError("no decoded tokens to schedule; ask each request for at least 2 tokens")
    depth = depthwise_steps(trajectories, n_slots, loops)
    seq = sequencewise_steps(trajectories, n_slots, loops)
    static = static_steps(trajectories, n_slots, loops)
    return {
        "decoded_tokens": tokens, "mean_exit_loop": sum(map(sum, trajectories)) / tokens,
        "depthwise_steps": depth, "sequencewise_steps": seq, "static_steps": static,
        "speedup_vs_sequencewise": seq / depth, "speedup_vs_static": static / depth,
    }
