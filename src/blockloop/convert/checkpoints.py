"""Converting a trained checkpoint: the targets of ``blockloop convert --to``, their options, and what they write.

An uptraining target (``block``, ``recursive``) turns a trained vanilla decoder into another family and
writes an ordinary checkpoint directory (weights, config, the source's tokenizer, train_state.json at step 0
keeping the source run's names), ready for ``blockloop train --init-from``. ``hf`` writes a Hugging Face
folder instead; ``weights`` the model alone (no optimizer state), optionally in bfloat16. Which targets
exist and the options each takes are :data:`blockloop.convert.targets.TARGETS`; :data:`CONVERTERS` performs them.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from blockloop.convert.hf import export_hf
from blockloop.convert.targets import TARGETS, implied_relaxation
from blockloop.convert.to_block import check_block_options, vanilla_to_block
from blockloop.convert.to_recursive import vanilla_to_recursive
from blockloop.data.dataset import prepare_tokens
from blockloop.data.loader import PackedSequences
from blockloop.errors import BlockloopError
from blockloop.families import spec_of
from blockloop.files import folder_in_place
from blockloop.train import checkpoint as ckpt
from blockloop.train.run import TrainedModel, check_learns_tasks, load_trained


@dataclass(frozen=True)
class Converted:
    """What a conversion wrote: ``out``, described as ``what`` (with the next step a user can take, ``hint``)."""

    out: Path
    what: str
    hint: str


def _write_uptraining(out: Path, model: nn.Module, source: TrainedModel, what: str) -> Converted:
    """Write ``model`` as a step-0 checkpoint with the source's tokenizer and run names, all at once, and the
    source's training window where the new model takes it: ``eval`` scores both on the same windows."""
    window = source.state.get("train_config", {}).get("seq_len")
    unit = spec_of(model.config).sequence_multiple(model.config)
    fits = window is not None and window % unit == 0 and window <= model.config.context_length
    with folder_in_place(out) as tmp:
        ckpt.save_model_files(tmp, model, model.config)
        source.tokenizer.save(tmp)
        ckpt.write_json_atomic(tmp / "train_state.json", {
            "step": 0, "run": source.state.get("run", {}), **({"train_config": {"seq_len": window}} if fits else {}),
            "converted_from": str(source.directory),
        })
    hint = f"uptrain with: blockloop train --init-from {shlex.quote(str(out))} --out RUN"
    if window is not None and not fits:  # said here: eval and training would silently take another window
        room = f"a whole number of its {unit}-token units" if window % unit else \
            f"within its context of {model.config.context_length}"
        hint += (f" (the source's training window of {window} tokens is not {room}, so eval and training take the "
                 f"default window: give --seq-len with a multiple of {unit})")
    return Converted(out, what, hint)


def to_block_checkpoint(checkpoint: str | Path, out: Path, *, block_len: int = 4, prefix_len: int | None = None) -> Converted:
    """A Block Transformer initialised from a trained vanilla decoder (Ho et al. 2024, uptraining)."""
    prefix_len = 2 if prefix_len is None else prefix_len
    check_block_options(block_len, prefix_len)
    out = ckpt.check_new_model_folder(out)
    source = load_trained(checkpoint)
    model = vanilla_to_block(source.model, block_len=block_len, prefix_len=prefix_len, pad_id=source.tokenizer.eos_id)
    if getattr(source.tokenizer, "task", None) is not None:  # refused here, not by the eval or training that reads it
        check_learns_tasks(model.config)
    what = f"{model.config.name} ({model.num_parameters() / 1e6:.2f}M parameters, {model.config.summary()})"
    return _write_uptraining(out, model, source, what)


def to_recursive_checkpoint(
    checkpoint: str | Path, out: Path, *, loops: int = 2, init: str = "stepwise", strategy: str = "cycle",
    relax: str | None = None, lora_rank: int = 0, lora_alpha: float | None = None, lora_init: str = "svd",
    prefix_len: int | None = None, norms: str = "per-loop", calibration: int = 8, seed: int = 0,
) -> Converted:
    """A (Relaxed) Recursive Transformer from a trained vanilla decoder (Bae et al. 2024, sections 2.2-2.3).

    The relaxation is per-loop LoRA (``lora_rank``) or per-position prefixes (``prefix_len``), never both:
    ``relax`` defaults to ``lora`` when a rank is given, ``prefix`` when a prefix length is, else ``none``.
    ``norms``: ``per-loop`` gives every norm of a shared layer one gain per loop (exact at full LoRA rank),
    ``tied`` shares them as the paper does.
    ``calibration``: windows of the source run's training data that make the SVD init activation-aware
    (0: the SVD of the weights alone).
    """
    relax = relax or implied_relaxation(lora_rank, prefix_len)
    if norms not in ("per-loop", "tied"):
        raise BlockloopError(f"--norms {norms} is unknown; choose per-loop or tied")
    prefix_len = prefix_len or 0
    if relax == "lora" and lora_rank < 1:
        raise BlockloopError("--relax lora needs --lora-rank R (R >= 1)")
    if relax == "prefix" and prefix_len < 1:
        raise BlockloopError("--relax prefix needs --prefix-len N (N >= 1)")
    if relax != "lora" and lora_rank:
        raise BlockloopError(f"--lora-rank is for --relax lora, not --relax {relax}")
    if relax != "prefix" and prefix_len:
        raise BlockloopError(f"--prefix-len is for --relax prefix, not --relax {relax}")
    out = ckpt.check_new_model_folder(out)
    source = load_trained(checkpoint)
    calibrate = relax == "lora" and lora_init == "svd" and calibration > 0
    model = vanilla_to_recursive(
        source.model, loops=loops, init=init, tying=strategy, lora_rank=lora_rank, lora_alpha=lora_alpha,
        lora_init=lora_init, prefix_len=prefix_len, loop_norms=norms == "per-loop",
        calibration=calibration_windows(source, calibration) if calibrate else None, seed=seed,
    )
    what = (f"{model.config.name} ({model.num_parameters() / 1e6:.2f}M parameters vs "
            f"{source.model.num_parameters() / 1e6:.2f}M; {model.config.summary()}, {init} init)")
    return _write_uptraining(out, model, source, what)


def calibration_windows(source: TrainedModel, count: int, seq_len: int = 128) -> torch.Tensor:
    """``(count, seq_len)`` token ids spread over the source run's training data, to calibrate an SVD init."""
    task = getattr(source.tokenizer, "task", None)  # a TaskTokenizer: the model reads a task's words
    if task is not None:
        raise BlockloopError(f"the source learned task {task}, not a text corpus to calibrate the SVD on; pass "
                             "--calibration 0 (the SVD of the weights alone)")
    data = source.state.get("run", {}).get("data")
    if data is None:
        raise BlockloopError("the source checkpoint records no training data to calibrate on; pass --calibration 0")
    try:
        tokens = prepare_tokens(data, source.tokenizer, show_progress=False).train
    except BlockloopError as exc:  # the run's text was moved or deleted since: convert has no flag to name other data
        raise BlockloopError(f"the source run's training data cannot be read to calibrate the SVD on ({exc}); put it "
                             "back where the run read it, or pass --calibration 0 (the SVD of the weights alone)") from None
    windows = PackedSequences(tokens, min(seq_len, source.config.context_length), source.tokenizer.start_id)
    if count > len(windows):  # every window is taken: say so, rather than appear to have used the count asked
        print(f"warning: --calibration {count} is more than the {len(windows)} windows of {windows.seq_len} tokens the "
              f"source's training data holds; calibrating on all {len(windows)}", file=sys.stderr)
    picks = torch.linspace(0, len(windows) - 1, min(count, len(windows))).long().tolist()
    return torch.stack([torch.from_numpy(windows[i][:-1]) for i in picks])


def to_hf_folder(checkpoint: str | Path, out: Path, *, save_dtype: str = "float32") -> Converted:
    """A trained vanilla decoder as a Hugging Face folder (config, weights, its tokenizer): :func:`export_hf`."""
    dtype = ckpt.save_dtype(save_dtype)
    out = ckpt.check_new_model_folder(out)
    source = load_trained(checkpoint)
    export_hf(source.model, source.tokenizer, out, dtype=dtype)
    return Converted(out, f"a Hugging Face model ({save_dtype})",
                     "load it with transformers.AutoModelForCausalLM / AutoTokenizer.from_pretrained")


def to_weights(checkpoint: str | Path, out: Path, *, save_dtype: str = "float32") -> Converted:
    """A checkpoint's model alone (config, weights, tokenizer; no optimizer or RNG state), in ``save_dtype``.

    The small form of a run to keep or share: ``eval``, ``generate`` and ``train --init-from`` read it; a
    training checkpoint (float32, with the optimizer) stays the only thing ``--resume`` continues.
    """
    dtype = ckpt.save_dtype(save_dtype)
    out = ckpt.check_new_model_folder(out)
    source = load_trained(checkpoint)
    with folder_in_place(out) as tmp:
        ckpt.save_model_files(tmp, source.model, source.config, dtype=dtype)
        source.tokenizer.save(tmp)
        # The run's training settings go along (no data position or optimizer, so --resume still refuses it), so
        # that `eval` scores the weights on the windows and objective it scores the run on.
        ckpt.write_json_atomic(tmp / "train_state.json", {
            "step": source.state.get("step", 0), "run": source.state.get("run", {}),
            **({"train_config": source.state["train_config"]} if "train_config" in source.state else {}),
            "converted_from": str(source.directory),
        })
    size = (out / "model.safetensors").stat().st_size
    return Converted(out, f"the weights of {source.config.name} ({save_dtype}, {size / 1e6:.1f} MB)",
                     f"use it like a run: blockloop generate --checkpoint {shlex.quote(str(out))} --prompt TEXT")


CONVERTERS: dict[str, Callable[..., Converted]] = {
    "block": to_block_checkpoint, "recursive": to_recursive_checkpoint, "hf": to_hf_folder, "weights": to_weights,
}
"""What performs each target of :data:`blockloop.convert.targets.TARGETS`: (checkpoint, out, **options)."""


def convert_checkpoint(target: str, checkpoint: str | Path, out: Path, **options: Any) -> Converted:
    """Convert ``checkpoint`` to ``target`` (a key of :data:`TARGETS`) with that target's ``options``."""
    if target not in TARGETS:
        raise BlockloopError(f"unknown conversion target {target!r}; choose one of {', '.join(TARGETS)}")
    takes = {option.name for option in TARGETS[target].options}
    unknown = sorted(set(options) - takes)
    if unknown:
        raise BlockloopError(f"conversion to {target} takes no option {', '.join(unknown)}; "
                             f"its options: {', '.join(sorted(takes)) or 'none'}")
    return CONVERTERS[target](checkpoint, Path(out), **options)
