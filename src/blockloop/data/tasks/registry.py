"""The named tasks: ``blockloop tasks make NAME`` and :func:`write_task` look them up here."""

from __future__ import annotations

from blockloop.data.tasks import algorithm, random_walk
from blockloop.data.tasks.base import Task
from blockloop.errors import BlockloopError


def _algorithm(num_variables: int) -> Task:
    return Task(
        name=f"algorithm-{num_variables}",
        description=f"Algorithm task, {num_variables} variables: output the value at each print of "
        "100-statement programs",
        vocab=algorithm.algorithm_vocab(num_variables),
        generate=algorithm.generator(num_variables),
        default_sizes=(10_000, 1_000, 1_000),
        details={
            "variables": list(algorithm.VARIABLES[num_variables]),
            "values": [algorithm.LOWEST, algorithm.HIGHEST],
            "statements_per_program": algorithm.STATEMENTS_PER_PROGRAM,
            "unit": "program",
        },
    )


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        _algorithm(3),
        _algorithm(5),
        Task(
            name="random-walk",
            description=f"Random Walk: output the agent's cell after each of {random_walk.ACTIONS_PER_SEQUENCE} "
            f"actions on a {random_walk.GRID_SIZE}x{random_walk.GRID_SIZE} grid",
            vocab=random_walk.VOCAB,
            generate=random_walk.generate,
            default_sizes=(5_000, 500, 500),
            details={
                "grid_size": random_walk.GRID_SIZE,
                "start": list(random_walk.START),
                "start_heading": "north",
                "actions_per_sequence": random_walk.ACTIONS_PER_SEQUENCE,
                "unit": "sequence",
            },
        ),
    )
}


def get_task(name: str) -> Task:
    """The registered task called ``name``; an unknown name is a user error that lists the known ones."""
    if name not in TASKS:
        raise BlockloopError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[name]
