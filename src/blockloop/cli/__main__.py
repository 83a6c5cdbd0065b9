"""``python -m blockloop.cli``: the console script, also under ``torchrun -m``."""

from blockloop.cli import main

raise SystemExit(main())
