"""Serving runners, one per model family, and the registry the engine builds them from.

:func:`runner_for` looks the model's family (``model.config.family``) up in :data:`RUNNERS`; a new family
registers its runner class here.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from blockloop.errors import BlockloopError
from blockloop.serve.runners.base import Runner
from blockloop.serve.runners.block import BlockRunner
from blockloop.serve.runners.decoder import DecoderRunner
from blockloop.serve.runners.double_decoder import DoubleDecoderRunner
from blockloop.serve.runners.encoder_decoder import EncoderDecoderRunner
from blockloop.serve.runners.paging import Paging
from blockloop.serve.runners.recursive import ExitRule, RecursiveRunner
from blockloop.serve.runners.speculative import Speculation
from blockloop.serve.runners.staircase import StaircaseRunner

RUNNERS: dict[str, type[Runner]] = {
    "decoder": DecoderRunner,
    "ladder": DecoderRunner,
    "recursive": RecursiveRunner,
    "block": BlockRunner,
    "double_decoder": DoubleDecoderRunner,
    "encoder_decoder": EncoderDecoderRunner,
    "staircase": StaircaseRunner,
}


OPTION_FLAGS = {"exit_rule": "--exit", "speculation": "--speculate", "paging": "--kv-tokens"}  # the CLI's names


def runner_for(model: nn.Module, **options: Any) -> Runner:
    """The runner serving ``model``'s family; ``options`` go to its constructor (a recursive model's
    ``exit_rule`` or ``speculation``, a double decoder's cached ``prefix``, a single-stack model's ``paging``); an option left ``None`` is
    dropped, so callers (the CLI, a server) may pass every option they know to any family."""
    family = model.config.family
    if family not in RUNNERS:
        raise BlockloopError(f"no serving runner for the {family!r} family; register one in blockloop.serve.runners.RUNNERS")
    known = inspect.signature(RUNNERS[family]).parameters
    unknown = sorted(name for name, value in options.items() if value is not None and name not in known)
    if unknown:
        def option(name: str) -> str:  # its CLI flag and the families that take it
            takers = [f for f, runner in RUNNERS.items() if name in inspect.signature(runner).parameters]
            flag = f"{OPTION_FLAGS[name]}; " if name in OPTION_FLAGS else ""
            takes = "family takes" if len(takers) == 1 else "families take"
            return f"{name} ({flag}{'the ' + ', '.join(takers) + f' {takes} it' if takers else 'no family takes it'})"
        raise BlockloopError(f"the {family} family's runner has no option {', '.join(map(option, unknown))}: drop it or "
                             "use a model that supports it")
    return RUNNERS[family](model, **{name: value for name, value in options.items() if name in known})


__all__ = ["RUNNERS", "ExitRule", "Paging", "Runner", "Speculation", "runner_for"]
