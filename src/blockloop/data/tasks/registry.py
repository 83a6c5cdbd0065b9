"""The named tasks: ``blockloop tasks make NAME`` and :func:`write_task` look them up here.

``NAME:N`` is a shorter (or longer) variant of a registered task: ``random-walk:64`` walks 64 actions
instead of 400, ``algorithm-3:20`` writes programs of 20 statements instead of 100. The paper's settings
are the plain names; the variants exist so a CPU can train on the same task at a size it can afford.
"""

from __future__ import annotations

import dataclasses

from blockloop.data.tasks import algorithm, random_walk
from blockloop.data.tasks.base import Task
from blockloop.errors import BlockloopError


def _algorithm(num_variables: int, statements: int = algorithm.STATEMENTS_PER_PROGRAM) -> Task:
    return Task(
        name=f"algorithm-{num_variables}",
        description=f"Algorithm task, {num_variables} variables: output the value at each print of "
        f"{statements}-statement programs",
        vocab=algorithm.algorithm_vocab(num_variables),
        generate=algorithm.generator(num_variables, statements),
        default_sizes=(10_000, 1_000, 1_000),
        details={
            "variables": list(algorithm.VARIABLES[num_variables]),
            "values": [algorithm.LOWEST, algorithm.HIGHEST],
            "statements_per_program": statements,
            "unit": "program",
        },
        min_tokens=3 * statements + 1,  # the shortest statements are three words (x ++ ; / print x ;), then END
    )


def _random_walk(length: int = random_walk.ACTIONS_PER_SEQUENCE) -> Task:
    return Task(
        name="random-walk",
        description=f"Random Walk: output the agent's cell after each of {length} "
        f"actions on a {random_walk.GRID_SIZE}x{random_walk.GRID_SIZE} grid",
        vocab=random_walk.VOCAB,
        generate=random_walk.generator(length),
        default_sizes=(5_000, 500, 500),
        details={
            "grid_size": random_walk.GRID_SIZE,
            "start": list(random_walk.START),
            "start_heading": "north",
            "actions_per_sequence": length,
            "unit": "sequence",
        },
        min_tokens=length + 1,  # one word per action, then END
    )


TASKS: dict[str, Task] = {task.name: task for task in (_algorithm(3), _algorithm(5), _random_walk())}
# The longest sequence a length variant may have: past it no model trains on whole sequences (the presets' contexts
# reach 2048), and writing the task only fills the disk.
MAX_TOKENS = 1 << 16

# How to build a task at another length (statements per program, actions per walk), for NAME:N.
_VARIANTS = {
    "algorithm-3": lambda n: _algorithm(3, n),
    "algorithm-5": lambda n: _algorithm(5, n),
    "random-walk": _random_walk,
}


def get_task(name: str) -> Task:
    """The task called ``name`` (or its ``NAME:N`` length variant); an unknown name lists the known ones."""
    base, sep, length = name.partition(":")
    if base not in TASKS:
        raise BlockloopError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)} (or NAME:LENGTH)")
    if not sep:
        return TASKS[name]
    if not length.isdigit() or int(length) < 1:
        raise BlockloopError(f"task {name!r}: the length after ':' must be a positive whole number, e.g. {base}:50")
    task = _VARIANTS[base](int(length))
    if task.min_tokens > MAX_TOKENS:
        raise BlockloopError(f"task {name!r}: its sequences take at least {task.min_tokens} tokens, past the limit of "
                             f"{MAX_TOKENS} per sequence (far beyond any preset's context); give a shorter length")
    return dataclasses.replace(task, name=name)
