"""Assembling a run from names: tokenizer + corpus + preset -> model and data, and back from a checkpoint.

The CLI, the demo and the tests all start runs here, so "what does --preset X --data Y --tokenizer Z
mean" has one answer. The names are stored in each checkpoint (``train_state.json``), which is what
lets ``--resume`` and ``eval`` rebuild the same data without being told again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blockloop.config import ModelConfig, round_up
from blockloop.data.corpora import load_documents
from blockloop.data.dataset import TokenSplits, prepare_tokens, split_documents
from blockloop.data.loader import PackedSequences
from blockloop.data.tasks import TaskData, TaskSequences, TaskTokenizer, TaskVocab, get_task, open_task
from blockloop.data.tokenizers import RAW_BYTES, Tokenizer, build_tokenizer, load_tokenizer
from blockloop.device import resolve_device
from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name, spec_of
from blockloop.train import checkpoint as ckpt
from blockloop.train.config import TrainConfig


@dataclass
class RunSpec:
    """What to train on: names and overrides, enough to rebuild the run."""

    preset: str = "demo"
    data: str = "shakespeare"
    tokenizer: str = "byte"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None
    # A labelled-position task (see blockloop.data.tasks) replaces data and tokenizer when set.
    task: str | None = None
    task_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PreparedRun:
    spec: RunSpec
    tokenizer: Tokenizer
    model_config: ModelConfig
    model: nn.Module
    splits: TokenSplits | TaskData


# Model config fields that prepare_run fills in from the tokenizer, whatever the preset says.
TOKENIZER_FIELDS = frozenset({"vocab_size", "padded_vocab_size", "pad_id"})


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round the embedding table up so matrix shapes stay tensor-core friendly (as Pythia's 50,304)."""
    return round_up(vocab_size, multiple)


def prepare_run(
    spec: RunSpec, *, seed: int = 0, show_progress: bool = True
) -> PreparedRun:
    """Tokenizer, token splits, and a model for ``spec``.

    The model is the preset initialised from ``seed``, or, with ``spec.init_from``, the weights, config
    and tokenizer of that checkpoint (fine-tuning, or uptraining a converted model).
    """
    if spec.init_from is not None:
        start = load_trained(spec.init_from)
        config, model = start.config, start.model
        if spec.model_overrides:  # --dropout: the same weights in the model built with it (dropout holds none)
            config = config.replace(**spec.model_overrides)
            model = build_model(config)
            model.load_state_dict(start.model.state_dict())
        splits = prepare_data(spec, start.tokenizer, config, show_progress=show_progress)
        torch.manual_seed(seed)  # the weights are loaded, but dropout draws from this generator
        return PreparedRun(spec, start.tokenizer, config, model.train(), splits)
    from_tokenizer = sorted(set(spec.model_overrides) & TOKENIZER_FIELDS)
    if from_tokenizer:
        raise BlockloopError(f"--set {from_tokenizer[0]}: this field is set from the tokenizer when the model is "
                             "built; choose the vocabulary with --tokenizer (or --task) instead")
    config = from_name(spec.preset, **spec.model_overrides)  # fail on a bad preset before any data work
    if spec.task is not None:
        check_learns_tasks(config)
        splits = open_task(spec.task, spec.task_dir, show_progress=show_progress, context=config.context_length)
        tokenizer: Tokenizer = TaskTokenizer(splits.name, splits.vocab)
    else:
        # Only a tokenizer trained on the corpus needs its documents: those of the training side, so that no
        # validation text shapes the vocabulary.
        documents = split_documents(load_documents(spec.data)).train if spec.tokenizer.split(":")[0] == "bpe" else None
        if spec.data.startswith("bytes:") and spec.tokenizer != "byte":  # before a tokenizer package is fetched
            raise BlockloopError(f"tokenizer {spec.tokenizer!r} cannot encode {RAW_BYTES}")
        tokenizer = build_tokenizer(spec.tokenizer, documents)
        splits = prepare_tokens(spec.data, tokenizer, show_progress=show_progress)
    padded = padded_vocab(tokenizer.vocab_size + config.reserved_ids)  # + span-corruption sentinels, if any
    vocab = {"vocab_size": tokenizer.vocab_size, "padded_vocab_size": padded}
    if spec_of(config).pad_with_eos:
        vocab["pad_id"] = tokenizer.eos_id  # block padding reads as "between documents"
    config = config.replace(**vocab)
    torch.manual_seed(seed)
    return PreparedRun(spec, tokenizer, config, build_model(config), splits)


def prepare_data(spec: RunSpec, tokenizer: Tokenizer, config: ModelConfig, *, show_progress: bool = True
                 ) -> TokenSplits | TaskData:
    """The data ``spec`` names, for a model that already has ``tokenizer`` (a checkpoint's)."""
    if spec.task is None:
        return prepare_tokens(spec.data, tokenizer, show_progress=show_progress)
    check_learns_tasks(config)
    if spec.task_dir is None:  # a built-in task, checked before it is generated
        check_task_vocabulary(tokenizer, spec.task, get_task(spec.task).vocab)
    data = open_task(spec.task, spec.task_dir, show_progress=show_progress, context=config.context_length)
    check_task_vocabulary(tokenizer, data.name, data.vocab)
    return data


def check_learns_tasks(config: ModelConfig) -> None:
    """Refuse a family whose batches drop a task's labels (:attr:`FamilySpec.next_token_windows`): it would train on
    something else and report that as the task error."""
    if not spec_of(config).next_token_windows:
        raise BlockloopError(f"the {config.family} family builds its targets from the inputs (block targets or span "
                             "corruption), not from a task's labels, so it cannot learn or be scored on a "
                             "labelled-position task; use a decoder, recursive, double-decoder or staircase-family preset")


def check_task_vocabulary(tokenizer: Tokenizer, task: str, vocab: TaskVocab) -> None:
    """Refuse a model whose ids do not mean the task's words: its predictions would be scored as nonsense.

    Between two task vocabularies the message names the task's words the model does not know, or, when it knows
    them all under other ids, says how to import data with the model's ids."""
    if isinstance(tokenizer, TaskTokenizer) and tokenizer.same_vocabulary(vocab):
        return
    problem = (f"the model's vocabulary ({tokenizer.name}, {tokenizer.vocab_size} ids) is not the vocabulary of task "
               f"{task} ({vocab.vocab_size} ids)")
    if isinstance(tokenizer, TaskTokenizer):
        unknown = [word for word in vocab.words if word not in tokenizer.vocab.words]
        if unknown:
            shown = " ".join(unknown[:5]) + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else "")
            problem += f": the model does not know the words {shown}"
        else:
            problem += ": the same words under other ids; `blockloop tasks import ... --vocab-from` the training data"
    raise BlockloopError(f"{problem}; use a model trained on {task} (or a variant of it)")


def default_seq_len(config: ModelConfig) -> int:
    """The window a model trains on and is scored on when none is given: the default ``--seq-len``, or the
    longest whole number of blocks / chunks the context holds when that is shorter."""
    unit = spec_of(config).sequence_multiple(config)
    return min(TrainConfig.seq_len, config.context_length // unit * unit)


def sequences(
    splits: TokenSplits | TaskData, seq_len: int, start_id: int | None = None, unit: int = 1
) -> tuple[PackedSequences | TaskSequences, PackedSequences | TaskSequences]:
    """Training and validation sequences: packed windows of a corpus (each starting with ``start_id``, the
    tokenizer's BOS where its model reads one first), or a task's train/valid windows (``unit``: what the model's
    ``--seq-len`` is a multiple of)."""
    if isinstance(splits, TaskData):
        return task_sequences(splits, "train", seq_len, unit), task_sequences(splits, "valid", seq_len, unit)
    return tuple(PackedSequences(getattr(splits, split), seq_len, start_id, description=f"the {split} split of the corpus")
                 for split in ("train", "val"))


def data_fingerprint(splits: TokenSplits | TaskData) -> str:
    """What identifies a run's training data, saved with each checkpoint so that ``--resume`` refuses data that
    changed under its saved position: a corpus's cache key, or a task's ``meta.json`` (generator, seed, sizes and
    token counts; for imported data, its source's)."""
    if isinstance(splits, TaskData):
        return hashlib.sha256(json.dumps(splits.meta, sort_keys=True).encode()).hexdigest()[:32]
    return splits.fingerprint


def task_sequences(data: TaskData, split: str, seq_len: int, unit: int = 1) -> TaskSequences:
    return TaskSequences(
        data.splits[split], seq_len, end_id=data.vocab.id("END"), description=f"the {split} split of task {data.name}",
        unit=unit,
    )


@dataclass
class TrainedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    directory: Path
    state: dict[str, Any]


def load_model_files(directory: Path) -> tuple[ModelConfig, nn.Module]:
    """The config and weights of a checkpoint directory: all a folder ``save_model_files`` wrote holds."""
    config = ckpt.load_checkpoint_config(directory)
    model = build_model(config)
    ckpt.load_model_state(directory, model)
    return config, model


def holds_model_alone(directory: Path) -> bool:
    """Whether ``directory`` is the model alone, as ``save_model_files`` writes it: no tokenizer, no train state."""
    return not any((directory / name).is_file() for name in ("tokenizer.json", "train_state.json"))


def load_trained(path: Path | str, device: str = "cpu") -> TrainedModel:
    """A model ready for inference from a run directory or checkpoint directory, on ``device`` (a name as
    ``--device`` takes: ``auto``, ``cpu``, ``cuda``, ``cuda:N``; checked before anything is read)."""
    device = resolve_device(str(device))
    directory = ckpt.resolve_checkpoint(Path(path))
    config, model = load_model_files(directory)
    if not (directory / "tokenizer.json").is_file():  # load_tokenizer reads any folder: a checkpoint says more
        if holds_model_alone(directory):
            raise BlockloopError(f"{directory} holds a model without its tokenizer (save_model_files writes the model "
                                 "alone); save the tokenizer beside it with tokenizer.save(folder)")
        raise ckpt.missing_file(directory / "tokenizer.json")
    tokenizer = load_tokenizer(directory)
    if tokenizer.vocab_size > config.vocab_size:  # its ids past the model's would index rows the model never learned
        raise BlockloopError(f"{directory}: the tokenizer has {tokenizer.vocab_size} ids but config.json's vocab_size "
                             f"is {config.vocab_size}; the config was edited or belongs to another model")
    state = ckpt.read_saved_state(directory)
    return TrainedModel(model.to(torch.device(device)).eval(), config, tokenizer, directory, state)
