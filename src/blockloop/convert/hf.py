"""Hugging Face causal LMs in and out of blockloop's own :class:`~blockloop.models.decoder.Decoder`.

Import reads a local folder (config.json + safetensors) or a GGUF file (dequantised by ``transformers``)
through ``transformers`` itself, translates the config (``hf_archs``) and renames/reshapes the weights with
the architecture's declarative key map. Export runs the same map backwards for a blockloop decoder whose
layer style one of those architectures has, and writes a folder, with the model's own tokenizer, that
``AutoModelForCausalLM`` and ``AutoTokenizer`` load. Nothing here reaches the network: ``transformers``
only sees local paths.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from blockloop.config import DecoderConfig
from blockloop.convert.hf_archs import ARCHITECTURES, Architecture
from blockloop.convert.hf_tokenizer import hf_tokenizer_files, special_ids
from blockloop.data.pretrained import gguf_parsed_once, quiet_transformers
from blockloop.data.tokenizers import Tokenizer
from blockloop.errors import BlockloopError
from blockloop.files import folder_in_place
from blockloop.models.decoder import Decoder
from blockloop.train.checkpoint import check_new_model_folder, os_error_of

SUPPORTED = ", ".join(ARCHITECTURES)
# Fields an exported model need not reproduce: naming, the vocabulary padding (exported as real rows),
# training-only settings.
_NOT_EXPORTED = {"name", "vocab_size", "padded_vocab_size", "dropout", "init", "init_std"}
_REPAIR = "re-export or re-download the model"
SAFETENSORS_NAMES = ("model.safetensors", "model.safetensors.index.json")  # what transformers loads, one or sharded


def architecture_for(hf_config: Any) -> Architecture:
    """The conversion of ``hf_config.model_type``, or a one-line error listing the supported ones."""
    return _architecture(getattr(hf_config, "model_type", None))


def _architecture(model_type: Any) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise BlockloopError(f"unsupported Hugging Face architecture {model_type!r}; supported: {SUPPORTED}")
    return ARCHITECTURES[model_type]


def check_source(path: Path, gguf_file: str | None) -> Path:
    """The file a model's config is read from (config.json, or the GGUF), refused in one line where it is missing
    or names an architecture blockloop does not convert: checked before anything else is read (the tokenizer), so
    the first error a wrong folder gets is that it holds no model."""
    if not path.is_dir():
        raise BlockloopError(f"{path} is not a directory; give a Hugging Face model folder (config.json + weights)")
    if gguf_file is not None:
        source = path / gguf_file
        if not source.is_file():
            raise BlockloopError(f"no GGUF file {gguf_file!r} in {path}; name a .gguf file inside that folder")
        return source
    source = path / "config.json"
    if not source.is_file():
        raise BlockloopError(f"no config.json in {path}; give a Hugging Face model folder, or --gguf-file for a GGUF")
    _architecture(_model_type(source))
    return source


def _load_hf_config(path: Path, gguf_file: str | None) -> Any:
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    source = check_source(path, gguf_file)
    extra = {"gguf_file": gguf_file} if gguf_file is not None else {}
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, **extra)
    # struct: a GGUF header cut short; the others: a field transformers looks up or checks (a dtype torch lacks)
    except (OSError, ValueError, StrictDataclassError, struct.error, AttributeError, KeyError, TypeError,
            AssertionError) as exc:
        raise BlockloopError(f"{source} is not a readable model config ({_described(exc)}); {_REPAIR}") from exc


def _model_type(config_file: Path) -> Any:
    """config.json's ``model_type``, read before ``transformers`` reads the file: its errors for broken JSON or
    an architecture it does not know are paragraphs that name neither the file nor what blockloop converts."""
    try:
        fields = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BlockloopError(f"{config_file} is not valid JSON ({exc}); {_REPAIR}") from None
    if not isinstance(fields, dict):
        raise BlockloopError(f"{config_file} holds a JSON {type(fields).__name__}, not an object of config fields; {_REPAIR}")
    if "model_type" not in fields:
        raise BlockloopError(f"{config_file} has no model_type, which names the architecture; {_REPAIR}")
    return fields["model_type"]


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _described(exc: Exception) -> str:
    """An exception in one line, named where its message alone says little (a KeyError's is the key)."""
    plain = isinstance(exc, (OSError, ValueError))
    return _one_line(exc) if plain else f"{type(exc).__name__}: {_one_line(exc)}"


@gguf_parsed_once()  # its config and its weights: one parse of a GGUF
def load_hf_model(path: Path | str, *, gguf_file: str | None = None) -> nn.Module:
    """The ``transformers`` model at ``path`` in float32 and eval mode (the reference that parity tests use)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    hf_config = _load_hf_config(path, gguf_file)
    architecture_for(hf_config)  # refuse an unsupported architecture before reading any weights
    if gguf_file is None and not any((path / name).is_file() for name in SAFETENSORS_NAMES):
        # the model's own weights by the names transformers reads: another .safetensors file beside pickle weights
        # (an adapter's) let transformers fall back to unpickling pytorch_model.bin
        pickles = sorted(p.name for p in (*path.glob("*.bin"), *path.glob("*.pt"), *path.glob("*.pth")))
        found = f"only pickle weights ({', '.join(pickles)}), which are never loaded (unpickling can run code)" \
            if pickles else f"neither {' nor '.join(SAFETENSORS_NAMES)}"
        raise BlockloopError(f"{path} holds {found}; give a folder with .safetensors weights (transformers' "
                             "save_pretrained writes them)")
    extra = {"gguf_file": gguf_file} if gguf_file is not None else {"use_safetensors": True}
    with quiet_transformers(), _no_load_report():
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                path, config=hf_config, dtype=torch.float32, local_files_only=True, ignore_mismatched_sizes=True,
                output_loading_info=True, **extra,
            )
        except (SafetensorError, OSError, ValueError, struct.error) as exc:  # struct: a GGUF cut short
            weights = path / gguf_file if gguf_file is not None else _safetensors_name(path)
            raise BlockloopError(f"{weights} cannot be read, it is corrupt or incomplete ({_one_line(exc)}); "
                                 f"{_REPAIR}") from None
        except (KeyError, AttributeError, TypeError, AssertionError) as exc:  # building the model from the config
            source = path / (gguf_file or "config.json")  # an activation, a RoPE type, a padding id it does not know
            raise BlockloopError(f"{source} describes a model transformers cannot build ({_described(exc)}); "
                                 f"{_REPAIR}") from exc  # chained: --debug shows where transformers gave up
    _check_loaded(info, path / gguf_file if gguf_file is not None else _safetensors_name(path),
                  path / (gguf_file or "config.json"))
    return model.eval()


def _safetensors_name(path: Path) -> str:
    """The weights file to name in an error: the one file, or of a sharded model's, the first whose header does not
    read (else all of them)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if len(files) == 1:
        return str(files[0])
    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError):
            return str(file)
    return f"the .safetensors files in {path}"


@contextmanager
def _no_load_report() -> Iterator[None]:
    """Only errors from ``transformers`` while loading: it logs a table of the weights it could not load as a
    warning, where :func:`_check_loaded` says what is wrong in one line."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _check_loaded(info: dict[str, Any], weights: Path | str, config: Path) -> None:
    """Refuse weights that do not fit the config: ``transformers`` leaves a tensor the file lacks, or holds in
    another shape, randomly initialised and drops one the model has no place for, so the import would be a
    different model that still runs."""
    if info["mismatched_keys"]:
        key, found, wanted = min(info["mismatched_keys"], key=lambda k: k[0])
        more = len(info["mismatched_keys"]) - 1
        problem = f"{key} is {list(found)} there but the config makes it {list(wanted)}" + (
            f" (and {more} more)" if more else "")
    elif info["missing_keys"]:
        problem = f"it lacks {_some(info['missing_keys'])}, which the config needs"
    elif info["unexpected_keys"]:
        problem = f"it holds {_some(info['unexpected_keys'])}, which the config has no place for"
    else:
        return
    raise BlockloopError(f"{weights} does not match {config}: {problem}; the folder mixes files of different "
                         f"models, {_REPAIR}")


def _some(keys: set[str]) -> str:
    first, *rest = sorted(keys)
    return first + (f" (and {len(rest)} more)" if rest else "")


@torch.no_grad()
def from_hf_model(hf_model: nn.Module, name: str | None = None, *, vocab_size: int | None = None,
                  share: bool = False) -> Decoder:
    """A blockloop Decoder with ``hf_model``'s weights (float32, eval mode).

    ``vocab_size`` is the ids of the tokenizer that goes with it. Where it has fewer than the model's embedding
    rows (a blockloop export writes its padded vocabulary as real rows), the rest stay as padding that
    generation never samples, as in the run the export came from. The model is built on the meta device and
    takes the converted tensors as its own, so no randomly initialised copy is made; with ``share`` the tensors
    that need no conversion stay ``hf_model``'s own (an import that discards it: one copy of the weights, not
    two), else they are copied (training one model must not change the other).
    """
    hf_config = hf_model.config
    arch = architecture_for(hf_config)
    config = arch.to_config(hf_config, name or hf_config.model_type)
    if vocab_size is not None and vocab_size < config.vocab_size:
        config = config.replace(vocab_size=vocab_size, padded_vocab_size=config.padded_vocab_size)
    state = arch.keymap.to_blockloop({k: v.float() for k, v in hf_model.state_dict().items()}, config)
    if not share:
        state = {k: v.clone() for k, v in state.items()}
    with torch.device("meta"):
        model = Decoder(config)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:  # assign gave the head a Parameter of its own over the same tensor: one again
        model.lm_head.weight = model.embed.weight
    return model.eval()


def import_hf(path: Path | str, *, gguf_file: str | None = None, vocab_size: int | None = None) -> Decoder:
    """The Hugging Face causal LM in folder ``path`` (or GGUF ``gguf_file`` inside it) as a blockloop Decoder
    (``vocab_size`` as in :func:`from_hf_model`)."""
    path = Path(path)
    name = Path(gguf_file).stem if gguf_file else path.name
    return from_hf_model(load_hf_model(path, gguf_file=gguf_file), name=name, vocab_size=vocab_size, share=True)


def _model_fields(config: DecoderConfig) -> dict[str, Any]:
    """The fields an export must reproduce, each None that stands for another field's value resolved to it
    (scores scaled by head_dim^-1/2; local layers rotated with the global base): the same model either way,
    which a Hugging Face config may spell out."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in _NOT_EXPORTED}
    if fields["attn_scalar"] is None:
        fields["attn_scalar"] = config.head_dim
    if config.local_layers and fields["local_rope_base"] is None:
        fields["local_rope_base"] = config.rope_base
    return fields


def export_architecture(config: DecoderConfig) -> Architecture:
    """The first architecture whose Hugging Face config reproduces every model field of ``config``.

    Checked by round trip (config -> Hugging Face config -> config), so a field an architecture cannot
    express (say, rotary embeddings in GPT-2, or muP logit scaling anywhere) rules it out.
    """
    if type(config) is not DecoderConfig:
        raise BlockloopError(f"only vanilla decoders export to Hugging Face, not {config.family} models")
    wanted = _model_fields(config)
    lost: dict[str, list[str]] = {}  # per architecture that takes the config at all: the fields it cannot express
    refused: list[str] = []  # blockloop's own reasons an architecture gave for refusing it
    for name, arch in ARCHITECTURES.items():
        back = _round_trip(arch, config)
        if isinstance(back, str):
            refused.append(back)
        elif back is not None:
            expressed = _model_fields(back)
            lost[name] = [f"{k}={v}" for k, v in wanted.items() if expressed[k] != v]
            if not lost[name]:
                return arch
    best = min(lost, key=lambda a: len(lost[a]), default=None)
    closest = f"; the closest, {best}, cannot express {', '.join(lost[best])}" if best else ""
    reasons = "".join(f"; {reason}" for reason in refused)
    raise BlockloopError(
        f"{config.name} ({config.norm}, {config.mlp} MLP, bias={config.bias}) matches no Hugging Face architecture "
        f"blockloop exports ({SUPPORTED}){closest}{reasons}; only vanilla models in one of those layer styles export"
    )


def _round_trip(arch: Architecture, config: DecoderConfig) -> DecoderConfig | str | None:
    """``config`` through ``arch``'s Hugging Face config and back; where blockloop's translation refuses it, its
    reason; None where transformers does."""
    try:
        with quiet_transformers():  # a config an architecture cannot take is expected here, not worth a warning
            return arch.to_config(arch.from_config(config), config.name)
    except BlockloopError as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - transformers rejects impossible configs with assorted error types
        return None


@torch.no_grad()
def to_hf_model(model: Decoder) -> nn.Module:
    """A ``transformers`` model with ``model``'s weights (float32)."""
    from transformers import AutoModelForCausalLM

    if not isinstance(model, Decoder) or type(model.config) is not DecoderConfig:
        raise BlockloopError(f"only vanilla decoders export to Hugging Face, not {model.config.family} models")
    config = model.config
    arch = export_architecture(config)
    hf_model = AutoModelForCausalLM.from_config(arch.from_config(config), dtype=torch.float32)
    state = arch.keymap.to_hf({k: v.detach().float().cpu() for k, v in model.state_dict().items()}, config)
    result = hf_model.load_state_dict(state, strict=False)
    embedding = hf_model.get_input_embeddings().weight
    untouched = [k for k in result.missing_keys if hf_model.get_parameter(k) is not embedding]
    if untouched or result.unexpected_keys:
        raise BlockloopError(f"export to {arch.hf_class} left {untouched or result.unexpected_keys} unmapped (a bug)")
    return hf_model.eval()


def export_hf(model: Decoder, tokenizer: Tokenizer, out_dir: Path | str, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``model`` with ``tokenizer`` as a Hugging Face folder and return it.

    ``AutoModelForCausalLM`` and ``AutoTokenizer`` load it: config.json and generation_config.json (the
    tokenizer's BOS/EOS/padding ids; the padded vocabulary rows suppressed, as blockloop's generation never
    samples them, so greedy decoding matches), model.safetensors in ``dtype``, and the tokenizer files of
    :mod:`blockloop.convert.hf_tokenizer`. ``blockloop convert --to hf`` writes through here too.
    """
    out = check_new_model_folder(out_dir)
    config = model.config
    if tokenizer.vocab_size > config.padded_vocab_size:
        raise BlockloopError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids but the model only "
            f"{config.padded_vocab_size}; "
            "export the model with the tokenizer it was trained with"
        )
    files = hf_tokenizer_files(tokenizer, model_max_length=config.context_length)
    hf_model = to_hf_model(model).to(dtype)
    ids = special_ids(tokenizer)
    for target in (hf_model.config, hf_model.generation_config):
        target.bos_token_id, target.eos_token_id, target.pad_token_id = ids.bos, ids.eos, ids.pad
    padding_rows = list(range(config.vocab_size, config.padded_vocab_size))
    hf_model.generation_config.suppress_tokens = padding_rows or None
    with folder_in_place(out) as tmp, quiet_transformers():
        try:
            hf_model.save_pretrained(tmp)
        except SafetensorError as exc:  # a full disk: the CLI's one line, naming the file
            raise os_error_of(exc, out / "model.safetensors") from exc
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
    return out
