"""The special tokens a source tokenizer declares: BOS, EOS, padding, and whether a text starts with BOS.

A pretrained model was trained with its own conventions, and guessing them costs quality: a model trained
with a BOS in front of every text reads a text without one much worse (and generates degenerate text), and
an EOS guessed from a list of usual names can be an ordinary token of another vocabulary, so generation
never stops and documents are joined with text. So they are read from the source, the way ``transformers``
reads them: ``tokenizer_config.json`` (``bos_token`` / ``eos_token`` / ``pad_token``, as a string or a
``{"content": ...}`` object; ``add_bos_token``), else ``special_tokens_map.json``; without ``add_bos_token``
a text starts with BOS exactly when the tokenizer.json's post-processor puts it there. GGUF metadata reaches
here through the ``tokenizer_config.json`` that :func:`blockloop.data.pretrained.convert_gguf_tokenizer` writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from blockloop.errors import BlockloopError

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the source's special tokens (None where it declares none) and whether texts start with BOS."""

    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False


def read_special_tokens(tokenizer: tokenizers.Tokenizer, folder: Path) -> SpecialTokens:
    """The special tokens ``folder``'s tokenizer files declare for ``tokenizer`` (its tokenizer.json)."""
    config: dict[str, object] = {}
    for name in reversed(CONFIG_FILES):  # tokenizer_config.json wins over special_tokens_map.json
        path = Path(folder) / name
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise BlockloopError(f"{path} is not valid JSON ({err}); repair or remove it") from None
            config.update(data if isinstance(data, dict) else {})
    ids = {role: _token_id(tokenizer, config.get(f"{role}_token")) for role in ("bos", "eos", "pad")}
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = ids["bos"] is not None and _post_processor_prefix(tokenizer)[:1] == [ids["bos"]]
    return SpecialTokens(ids["bos"], ids["eos"], ids["pad"], add_bos and ids["bos"] is not None)


def _token_id(tokenizer: tokenizers.Tokenizer, token: object) -> int | None:
    content = token.get("content") if isinstance(token, dict) else token
    return tokenizer.token_to_id(content) if isinstance(content, str) else None


def _post_processor_prefix(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """The ids the tokenizer's post-processor puts before a text."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    starts = [k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain]
    return full[: starts[0]] if starts else []
