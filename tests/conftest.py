"""Shared test settings: one corpus/token cache for the whole session, kept between runs."""

from __future__ import annotations

import os
from pathlib import Path

# Tests fetch the corpus packages once into a repo-local cache (git-ignored) so repeated runs are
# offline and fast; set BLOCKLOOP_CACHE to share another cache.
os.environ.setdefault("BLOCKLOOP_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "blockloop"))
