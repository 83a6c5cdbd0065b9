"""``blockloop convert --from-hf``: Hugging Face models to blockloop checkpoints (``--to hf`` is
:func:`blockloop.convert.hf.export_hf`).

An imported model is written as an ordinary checkpoint directory (model.safetensors, config.json,
tokenizer files, train_state.json at step 0), so ``eval``, ``generate`` and ``train --init-from`` read it
like any run. Its tokenizer is the source's own: the folder's tokenizer.json, the GGUF's vocabulary
converted by ``transformers``, or the built-in ``smollm2`` one, each with its chat template where it has one.
"""

from __future__ import annotations

import shlex
import struct
import tempfile
from pathlib import Path

from blockloop.convert.hf import check_source, import_hf
from blockloop.data.pretrained import SMOLLM2_GGUF, convert_gguf_tokenizer, gguf_parsed_once, smollm2_files
from blockloop.data.tokenizers import Tokenizer, build_tokenizer, hf_folder_tokenizer
from blockloop.errors import BlockloopError
from blockloop.files import folder_in_place
from blockloop.models.decoder import Decoder
from blockloop.train import checkpoint as ckpt

BUILTIN = "smollm2"


def _source_tokenizer(path: Path, gguf_file: str | None) -> Tokenizer:
    """The source's own tokenizer: the folder's tokenizer.json, else the GGUF's vocabulary (with its chat template)."""
    if (path / "tokenizer.json").is_file() or gguf_file is None:
        return hf_folder_tokenizer(path, name=str((path / "tokenizer.json").resolve()))
    if not (path / gguf_file).is_file():
        raise BlockloopError(f"no GGUF file {gguf_file!r} in {path}; name a .gguf file inside that folder")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            converted = convert_gguf_tokenizer(path, gguf_file, Path(tmp))
        except (OSError, ValueError, struct.error) as exc:  # transformers' reading of a truncated or foreign file
            raise BlockloopError(f"{path / gguf_file} holds no readable tokenizer, or is cut short ({exc}); "
                                 "re-download the GGUF, or pass --tokenizer") from None
        return hf_folder_tokenizer(converted, name=str((path / gguf_file).resolve()))


@gguf_parsed_once()  # a GGUF's tokenizer, config and weights: one parse
def import_checkpoint(
    source: str, out: Path, *, gguf_file: str | None = None, tokenizer: str | None = None, data: str = "shakespeare",
    save_dtype: str = "float32",
) -> tuple[Decoder, Tokenizer]:
    """Convert ``source`` (a Hugging Face folder, or ``smollm2``) into the checkpoint directory ``out``.

    ``data`` is recorded as the run's corpus, what ``eval`` scores unless told otherwise. The model's
    ``vocab_size`` is the tokenizer's: embedding rows beyond its ids (an export's padded vocabulary) stay padding.
    The returned model is float32 whatever ``save_dtype`` the weights are written in (a source in bfloat16 loses
    nothing written so; loading casts them back). Everything is read and checked before ``out`` is created, so a
    failed import leaves nothing there.
    """
    dtype = ckpt.save_dtype(save_dtype)
    out = ckpt.check_new_model_folder(out)
    if source == BUILTIN:
        if gguf_file is not None:
            raise BlockloopError("--from-hf smollm2 is the built-in GGUF; leave out --gguf-file")
        path, gguf_file, tokenizer = smollm2_files(), SMOLLM2_GGUF, tokenizer or BUILTIN
    else:
        path = Path(source)
    if not path.is_dir():
        raise BlockloopError(f"{path} is not a directory; give a Hugging Face model folder, or 'smollm2'")
    if any((folder / marker).exists() for folder in (path, ckpt.checkpoint_root(path))  # a run, its checkpoints
           for marker in ("train_state.json", ckpt.LATEST)):  # or one of them: what blockloop writes, HF does not
        raise BlockloopError(f"{path} is a blockloop run or checkpoint, not a Hugging Face folder; it needs no import: "
                             f"give it as --checkpoint, or export it with convert --to hf --checkpoint {shlex.quote(str(path))}")
    check_source(path, gguf_file)
    if tokenizer is not None and tokenizer.split(":")[0] == "bpe":
        raise BlockloopError("--tokenizer bpe is trained on a corpus, so its ids would not be the ones the imported "
                             "weights were trained on; leave --tokenizer out to keep the source's own")
    tok = build_tokenizer(tokenizer) if tokenizer else _source_tokenizer(path, gguf_file)
    if tokenizer and tokenizer != BUILTIN and ((path / "tokenizer.json").is_file() or gguf_file is not None):
        # the weights were trained on the ids of the source's own: another numbering of another size is garbage
        own = _source_tokenizer(path, gguf_file)
        if tok.vocab_size != own.vocab_size:
            raise BlockloopError(f"tokenizer {tok.name!r} has {tok.vocab_size} ids where the source's own has "
                                 f"{own.vocab_size}: the weights were trained on its ids; leave --tokenizer out")
    model = import_hf(path, gguf_file=gguf_file, vocab_size=tok.vocab_size)
    if tok.vocab_size > model.config.padded_vocab_size:
        raise BlockloopError(
            f"tokenizer {tok.name!r} has {tok.vocab_size} ids but the model only {model.config.padded_vocab_size}; "
            "pass the model's own tokenizer"
        )
    run = {"preset": model.config.name, "data": data, "tokenizer": tok.name}
    with folder_in_place(out) as tmp:
        ckpt.save_model_files(tmp, model, model.config, dtype=dtype)
        tok.save(tmp)
        ckpt.write_json_atomic(tmp / "train_state.json", {"step": 0, "run": run, "converted_from": str(path / (gguf_file or ""))})
    return model, tok
