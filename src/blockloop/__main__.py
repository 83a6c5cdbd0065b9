"""``python -m blockloop``: the same as the ``blockloop`` console script (``python -m blockloop.cli`` too)."""

from blockloop.cli import main

raise SystemExit(main())
