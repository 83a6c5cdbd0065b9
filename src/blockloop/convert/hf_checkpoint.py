"""``blockloop convert --from-hf`` / ``--to hf``: Hugging Face models to blockloop checkpoints and back.

An imported model is written as an ordinary checkpoint directory (model.safetensors, config.json,
tokenizer files, train_state.json at step 0), so ``eval``, ``generate`` and ``train --init-from`` read it
like any run. Its tokenizer is the source's own: the folder's tokenizer.json, the GGUF's vocabulary
converted by ``transformers``, or the built-in ``smollm2`` one.
"""

from __future__ import annotations

from pathlib import Path

from blockloop.convert.hf import export_hf, import_hf
from blockloop.data.pretrained import SMOLLM2_GGUF, quiet_transformers, smollm2_files
from blockloop.data.tokenizers import Tokenizer, build_tokenizer
from blockloop.errors import BlockloopError
from blockloop.files import atomic_write_text
from blockloop.models.decoder import Decoder
from blockloop.train import checkpoint as ckpt

BUILTIN = "smollm2"


def _source_tokenizer(path: Path, gguf_file: str | None, out: Path) -> Tokenizer:
    if (path / "tokenizer.json").is_file():
        return build_tokenizer(str(path / "tokenizer.json"))
    if gguf_file is None:
        raise BlockloopError(f"no tokenizer.json in {path}; pass --tokenizer (e.g. gpt2, neox or a tokenizer.json path)")
    from transformers import AutoTokenizer

    if not (path / gguf_file).is_file():
        raise BlockloopError(f"no GGUF file {gguf_file!r} in {path}; name a .gguf file inside that folder")
    with quiet_transformers():
        converted = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "tokenizer.json", converted.backend_tokenizer.to_str())
    return build_tokenizer(str(out / "tokenizer.json"))


def import_checkpoint(
    source: str, out: Path, *, gguf_file: str | None = None, tokenizer: str | None = None, data: str = "shakespeare"
) -> tuple[Decoder, Tokenizer]:
    """Convert ``source`` (a Hugging Face folder, or ``smollm2``) into the checkpoint directory ``out``.

    ``data`` is recorded as the run's corpus, what ``eval`` scores unless told otherwise.
    """
    out = Path(out)
    if (out / "model.safetensors").exists():
        raise BlockloopError(f"{out} already holds a model; choose another --out")
    if source == BUILTIN:
        if gguf_file is not None:
            raise BlockloopError("--from-hf smollm2 is the built-in GGUF; leave out --gguf-file")
        path, gguf_file, tokenizer = smollm2_files(), SMOLLM2_GGUF, tokenizer or BUILTIN
    else:
        path = Path(source)
    if not path.is_dir():
        raise BlockloopError(f"{path} is not a directory; give a Hugging Face model folder, or 'smollm2'")
    tok = build_tokenizer(tokenizer) if tokenizer else _source_tokenizer(path, gguf_file, out)
    model = import_hf(path, gguf_file=gguf_file)
    if tok.vocab_size > model.config.padded_vocab_size:
        raise BlockloopError(
            f"tokenizer {tok.name!r} has {tok.vocab_size} ids but the model only {model.config.padded_vocab_size}; "
            "pass the model's own tokenizer"
        )
    out.mkdir(parents=True, exist_ok=True)
    ckpt.save_model_files(out, model, model.config)
    tok.save(out)
    run = {"preset": model.config.name, "data": data, "tokenizer": tok.name}
    ckpt.write_json_atomic(out / "train_state.json", {"step": 0, "run": run, "converted_from": str(path / (gguf_file or ""))})
    return model, tok


def export_checkpoint(model: Decoder, tokenizer: Tokenizer, out: Path) -> Path:
    """Write a trained blockloop decoder as a Hugging Face folder, with its tokenizer.json where it has one."""
    out = export_hf(model, out)
    if tokenizer.name != "byte":  # the byte tokenizer has no Hugging Face form
        tokenizer.save(out)
    return out
