"""The tokenizer half of a Hugging Face export: files ``transformers.AutoTokenizer`` loads with blockloop's ids.

``tokenizer.json`` is the run tokenizer's Hugging Face form (:meth:`~blockloop.data.tokenizers.Tokenizer.hf_tokenizer`:
the byte tokenizer as a merge-free byte-level BPE, every other text tokenizer as its own tokenizer.json).
``tokenizer_config.json`` names the special tokens and keeps ``transformers`` from changing what the tokenizer
does: the generic fast class (no model-specific rewriting of the pipeline), no clean-up of spaces on decode,
and special-token text split like any text where blockloop reads it as text (the byte tokenizer encodes
``<|endoftext|>`` as its 13 bytes). The chat template goes along where the source tokenizer had one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import tokenizers
from tokenizers import processors

from blockloop.data.tokenizers import Tokenizer


@dataclass(frozen=True)
class SpecialIds:
    """The ids ``config.json`` and ``generation_config.json`` name."""

    bos: int
    eos: int
    pad: int


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """The source's BOS where it declared one, else the end-of-text id (GPT-2's convention: a document starts
    after an end-of-text); padding is the tokenizer's own padding token, else end-of-text."""
    eos = tokenizer.eos_id
    bos = eos if tokenizer.bos_id is None else tokenizer.bos_id
    return SpecialIds(bos=bos, eos=eos, pad=eos if tokenizer.pad_id is None else tokenizer.pad_id)


def hf_tokenizer_files(tokenizer: Tokenizer, *, model_max_length: int) -> dict[str, str]:
    """File name -> text of the tokenizer files of an export (raises for a tokenizer with no Hugging Face form)."""
    hf = tokenizer.hf_tokenizer()
    _start_texts_as_blockloop_does(hf, tokenizer)
    ids = special_ids(tokenizer)
    eos_text = hf.id_to_token(ids.eos)
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": hf.id_to_token(ids.bos),
        "eos_token": eos_text,
        "pad_token": hf.id_to_token(ids.pad),
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": tokenizer.encode(eos_text) != [ids.eos],
        "add_bos_token": tokenizer.add_bos,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    return {"tokenizer.json": hf.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def _start_texts_as_blockloop_does(hf: tokenizers.Tokenizer, tokenizer: Tokenizer) -> None:
    """Make ``hf``'s post-processor put BOS before a text exactly when blockloop's prompts start with it.

    A source's ``add_bos_token`` may disagree with its tokenizer.json's post-processor, and blockloop follows
    the former; the generic tokenizer class an export names follows only the post-processor (and blockloop's
    re-import, without ``add_bos_token``, too). So where the two differ the post-processor is rewritten.
    """
    probe = "a"
    if hf.encode(probe, add_special_tokens=True).ids == tokenizer.encode_prompt(probe):
        return
    start = [] if tokenizer.start_id is None else [(hf.id_to_token(tokenizer.start_id), tokenizer.start_id)]
    prefix = [f"{token}:0" for token, _ in start]
    hf.post_processor = processors.TemplateProcessing(
        single=" ".join([*prefix, "$A:0"]), pair=" ".join([*prefix, "$A:0", *(f"{t}:1" for t, _ in start), "$B:1"]),
        special_tokens=start,
    )
