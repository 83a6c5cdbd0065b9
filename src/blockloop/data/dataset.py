"""Corpus -> train/validation token streams, tokenized once and memory-mapped from the cache.

Cache layout: ``<cache>/tokens/<key>/{train.bin,val.bin,meta.json}``, where ``key`` hashes the documents'
content, the tokenizer's spec and vocabulary, ``val_fraction`` and :data:`_FORMAT`. Any change to one of
them tokenizes afresh; otherwise the ``.bin`` files are simply mapped, so a second run starts instantly
and many processes (DDP ranks) share one copy in the page cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from blockloop import progress
from blockloop.data.corpora import hash_documents, load_documents
from blockloop.data.packages import cache_dir
from blockloop.data.tokenizers import RAW_BYTES, ByteTokenizer, Tokenizer
from blockloop.errors import BlockloopError
from blockloop.files import folder_in_place

# Bump whenever the stream layout or split rule changes, so stale caches are not reused.
_FORMAT = 2
# The share of a corpus held out for validation.
VAL_FRACTION = 0.05
# Below this many documents, holding out whole documents gives too coarse a validation fraction.
_MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT = 20
# Characters handed to one encode_batch call: large enough to keep all cores busy, small enough for a
# progress bar that moves.
_CHARS_PER_BATCH = 1 << 20


@dataclass
class TokenSplits:
    """Training and validation token streams: read-only memory maps, uint16 if the vocab fits, else uint32."""

    train: np.ndarray
    val: np.ndarray
    fingerprint: str  # the corpus text, its split and the tokenizer (the cache key): what --resume checks


def prepare_tokens(
    source: str, tokenizer: Tokenizer, *, val_fraction: float = VAL_FRACTION, show_progress: bool = True
) -> TokenSplits:
    """Tokenize corpus ``source`` (see :func:`load_documents`) into cached train/validation streams.

    Each document is encoded and followed by ``tokenizer.eos_id``; the documents are concatenated in
    order. Which text is held out is decided by :func:`split_documents` before tokenizing, so it does not
    depend on the tokenizer and a tokenizer trained on the corpus can be trained on the training side only.

    An empty split raises :class:`BlockloopError`.
    """
    documents = load_documents(source)
    if not isinstance(tokenizer, ByteTokenizer) and any(isinstance(doc, bytes) for doc in documents):
        raise BlockloopError(f"tokenizer {tokenizer.name!r} cannot encode {RAW_BYTES}")  # before any progress line
    key = hashlib.sha256(
        json.dumps([_FORMAT, tokenizer.name, tokenizer.fingerprint(), repr(val_fraction)]).encode()
        + hash_documents(documents).encode()
    ).hexdigest()[:32]
    folder = cache_dir() / "tokens" / key
    if _read_cache(folder) is None:
        shutil.rmtree(folder, ignore_errors=True)  # absent, or damaged (a truncated file): tokenized afresh
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
        split = split_documents(documents, val_fraction)
        description = f"tokenizing {source} ({tokenizer.name})"
        encoded = _encode(split.train + split.val, tokenizer, dtype, description, show_progress)
        if split.continues:  # the last training piece goes on in validation: no end-of-text between them
            encoded[len(split.train) - 1] = encoded[len(split.train) - 1][:-1]
        train = _concatenate(encoded[: len(split.train)], dtype)
        val = _concatenate(encoded[len(split.train) :], dtype)
        if len(train) == 0 or len(val) == 0:
            raise BlockloopError(
                f"corpus {source!r} is too small to split into training and validation "
                f"({len(train) + len(val)} tokens); give it more text"
            )
        meta = {
            "format": _FORMAT,
            "source": source,
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "dtype": np.dtype(dtype).name,
            "documents": len(documents),
            "split": split.rule,
            "train_tokens": len(train),
            "val_tokens": len(val),
        }
        _write_atomically(folder, {"train.bin": train, "val.bin": val}, meta)
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    return TokenSplits(
        train=np.memmap(folder / "train.bin", dtype=meta["dtype"], mode="r", shape=(meta["train_tokens"],)),
        val=np.memmap(folder / "val.bin", dtype=meta["dtype"], mode="r", shape=(meta["val_tokens"],)),
        fingerprint=key,
    )


def _encode(
    documents: Sequence[str | bytes],
    tokenizer: Tokenizer,
    dtype: type[np.unsignedinteger],
    description: str,
    show_progress: bool,
) -> list[np.ndarray]:
    """Ids of every document as ``dtype``, each followed by EOS, in batches sized for a steady progress bar.

    Converting to the storage dtype per document keeps peak memory near the size of the final stream.
    """
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    encoded: list[np.ndarray] = []
    with progress.bar(
        total=sum(len(doc) for doc in documents),
        unit="char",
        unit_scale=True,
        desc=description,
        disable=not show_progress,
        log_every=60,
    ) as bar:
        for batch in _batches(documents):
            for ids in tokenizer.encode_batch(batch):
                encoded.append(np.concatenate([ids.astype(dtype), eos]))
            bar.update(sum(len(doc) for doc in batch))
    return encoded


def _batches(documents: Sequence[str | bytes]) -> Iterator[Sequence[str | bytes]]:
    start = 0
    size = 0
    for end, doc in enumerate(documents, start=1):
        size += len(doc)
        if size >= _CHARS_PER_BATCH or end == len(documents):
            yield documents[start:end]
            start, size = end, 0


@dataclass
class DocumentSplit:
    """The corpus text on each side of the train/validation split (see :func:`split_documents`)."""

    train: list[str | bytes]
    val: list[str | bytes]
    rule: str  # "documents": whole documents held out; "tail": the end of the text
    continues: bool = False  # the last training piece and the first validation piece are one document, cut


def split_documents(documents: Sequence[str | bytes], val_fraction: float = VAL_FRACTION) -> DocumentSplit:
    """Hold out about ``val_fraction`` of the corpus's characters (bytes for binary data), deterministically.

    * With at least 20 documents, whole documents are held out, so validation text is never seen in
      training, not even as the other half of a document. Walking documents in order, a document goes to
      validation when doing so keeps validation at most ``val_fraction`` of the text seen so far; this
      spreads held-out documents evenly over the corpus (every ~1/val_fraction-th document when they are
      of similar size) and lands close to ``val_fraction`` of all text.
    * With fewer documents, or when that rule holds out less than half of ``val_fraction`` (a few huge
      documents), the last ``val_fraction`` of the text is validation instead, cutting the document it
      starts in.

    Lengths count one extra for each document's end-of-text token, so a corpus of many short documents
    splits like its token stream would.
    """
    if not 0.0 < val_fraction < 1.0:
        raise BlockloopError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if len(documents) >= _MIN_DOCUMENTS_FOR_DOCUMENT_SPLIT:
        train, val = [], []
        seen = held_out = 0
        for doc in documents:
            size = len(doc) + 1
            seen += size
            if held_out + size <= val_fraction * seen:
                val.append(doc)
                held_out += size
            else:
                train.append(doc)
        if held_out >= 0.5 * val_fraction * seen:
            return DocumentSplit(train, val, "documents")
    total = sum(len(doc) for doc in documents)
    cut = total - round(val_fraction * total)  # offset into the joined text where validation starts
    train, val = [], []
    continues = False
    start = 0
    for doc in documents:
        if start + len(doc) <= cut:
            train.append(doc)
        elif start >= cut:
            val.append(doc)
        else:
            train.append(doc[: cut - start])
            val.append(doc[cut - start :])
            continues = True
        start += len(doc)
    return DocumentSplit(train, val, "tail", continues)


def _concatenate(arrays: list[np.ndarray], dtype: type[np.unsignedinteger]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)


def _read_cache(folder: Path) -> dict[str, Any] | None:
    """The meta of a complete cache entry, or None when it is missing or does not match its .bin files."""
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        itemsize = np.dtype(meta["dtype"]).itemsize
        sizes = {"train.bin": meta["train_tokens"] * itemsize, "val.bin": meta["val_tokens"] * itemsize}
        if meta.get("format") == _FORMAT and all((folder / n).stat().st_size == size for n, size in sizes.items()):
            return meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_atomically(folder: Path, arrays: dict[str, np.ndarray], meta: dict[str, object]) -> None:
    """Write arrays and meta into a hidden sibling folder, then rename it to ``folder`` in one step."""
    with folder_in_place(folder, shared=True) as tmp:
        for name, array in arrays.items():
            array.tofile(tmp / name)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
