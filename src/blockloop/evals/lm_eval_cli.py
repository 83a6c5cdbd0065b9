"""``python -m blockloop.evals.lm_eval_cli run --model blockloop --model_args checkpoint=RUN --tasks ...``: lm-eval's
own command line, every flag of it, with the ``blockloop`` model type registered. lm-eval 0.4.13 finds a model
only once its module is imported, so a bare ``lm-eval --model blockloop`` cannot see it."""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

import blockloop.evals.lm_eval_bridge  # noqa: F401  (registers the "blockloop" model type)
from blockloop.errors import BlockloopError


def main() -> int:
    try:
        cli_evaluate()
    except BlockloopError as exc:  # a missing checkpoint, a bad model_args value: one line, as blockloop's verbs say it
        print(f"lm-eval (blockloop model): error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
