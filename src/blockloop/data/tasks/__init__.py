"""Synthetic state-tracking tasks (Algorithm, Random Walk) for models with recurrence over time.

Each task is a token stream with labels at the positions where the model must report a tracked state;
see :mod:`blockloop.data.tasks.base` for the stream format and :mod:`blockloop.data.tasks.files` for the
on-disk layout written by ``blockloop tasks make``; :mod:`blockloop.data.tasks.imported` writes the same
layout from your own labelled sequences (``blockloop tasks import``).
"""

from blockloop.data.tasks.base import IGNORE_INDEX, SPLITS, Task, TaskStream, TaskVocab
from blockloop.data.tasks.files import TaskData, generate_splits, load_task, open_task, write_task
from blockloop.data.tasks.imported import import_task
from blockloop.data.tasks.metrics import labelled_errors, task_error
from blockloop.data.tasks.registry import TASKS, get_task
from blockloop.data.tasks.tokenizer import TaskTokenizer
from blockloop.data.tasks.windows import TaskSequences

__all__ = [
    "IGNORE_INDEX",
    "SPLITS",
    "TASKS",
    "Task",
    "TaskData",
    "TaskSequences",
    "TaskStream",
    "TaskTokenizer",
    "TaskVocab",
    "generate_splits",
    "get_task",
    "import_task",
    "labelled_errors",
    "load_task",
    "open_task",
    "task_error",
    "write_task",
]
