"""Shared test settings: one corpus/token cache for the whole session, kept between runs; the longest test first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Inductor's CPU compile imports setuptools, whose distutils shim asserts (BackendCompilerFailed) when the standard
# library's distutils is already in the process; a full run once failed every compile test of one worker that way.
# Imported here, first, the shim is in place before anything can import the old one.
import setuptools  # noqa: F401, E402  isort: skip

# Tests fetch the corpus packages once into a repo-local cache (git-ignored) so repeated runs are
# offline and fast; set BLOCKLOOP_CACHE to share another cache.
os.environ.setdefault("BLOCKLOOP_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "blockloop"))

# Under pytest-xdist (make test runs two workers) each worker gets its share of the cores, before torch is
# imported: two workers each spinning as many OpenMP threads as there are cores slow each other down.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``longest`` first (the order is otherwise kept). ``make test`` runs two workers that steal
    work from each other; a test that alone takes most of the suite's time must start at once on one of them,
    or the suite ends only when it does, long after the other worker has run out of tests."""
    items.sort(key=lambda item: item.get_closest_marker("longest") is None)
