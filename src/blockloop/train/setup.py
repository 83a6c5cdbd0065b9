"""What a training request means: a fresh run, ``--resume``, ``--init-from``, a task run, early-exit options.

``blockloop train`` and the Python API share these answers. A request names things (preset, data,
tokenizer, task, a checkpoint to start from) and leaves out what it does not set; :func:`plan_run` turns it
into the :class:`RunSpec` the run records, where its model comes from, and its :class:`TrainConfig`, refusing
combinations that cannot mean one thing. :func:`start_training` then builds the model, data and trainer.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockloop.config import ModelConfig, from_fields
from blockloop.data.corpora import absolute_source, corpus_is_there
from blockloop.errors import BlockloopError
from blockloop.families import spec_of
from blockloop.train import checkpoint as ckpt
from blockloop.train.config import TrainConfig
from blockloop.train.distill import build_distillation
from blockloop.train.distributed import DistInfo
from blockloop.train.run import (
    PreparedRun,
    RunSpec,
    data_fingerprint,
    default_seq_len,
    prepare_run,
    sequences,
)
from blockloop.train.trainer import Trainer


@dataclass(frozen=True)
class EarlyExit:
    """The early-exit loss fields of a looped model's config (Bae et al. 2024, section 3.7); None = unchanged."""

    exit_loss: str | None = None
    exit_coefficient: float | None = None
    exit_kd_weight: float | None = None

    def changes(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class TrainRequest:
    """A training run asked for by name; None (or empty) means "not given", so defaults and saved values apply."""

    out: Path
    resume: bool = False
    init_from: str | None = None
    preset: str | None = None
    data: str | None = None
    tokenizer: str | None = None
    task: str | None = None
    task_dir: str | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)  # config fields to set (``--set``)
    dropout: float | None = None
    mup_base_width: int | None = None
    train_overrides: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields given
    tokens: float | None = None  # a token budget that sets the step count
    early_exit: EarlyExit = field(default_factory=EarlyExit)
    distill_from: str | None = None
    distill_weight: float | None = None  # 1.0 when distilling

    def __post_init__(self) -> None:
        # From Python as from the CLI: a str folder, and a training field that does not exist named (not a TypeError).
        self.out = Path(self.out)
        settings = [f.name for f in dataclasses.fields(TrainConfig) if not f.name.startswith("distill_")]
        unknown = sorted(set(self.train_overrides) - set(settings))
        if unknown:  # the teacher is pinned and checked by distill_from/distill_weight, the request's own fields
            raise BlockloopError(f"train_overrides names no training setting {', '.join(unknown)}; the settings are "
                                 f"{', '.join(settings)} (a teacher: distill_from, distill_weight)")


@dataclass
class RunPlan:
    """A request resolved: what the run records (``spec``), where its model comes from (``source``), how it trains."""

    spec: RunSpec
    source: RunSpec
    config: TrainConfig
    out: Path
    resume: bool
    early_exit: EarlyExit
    tokens: float | None
    # A fresh run without --seq-len: the default window shrinks to what the model's context holds.
    fit_seq_len: bool = False


def dropout_fields(dropout: float | None) -> dict[str, float]:
    """The config fields ``--dropout`` sets: the embeddings' rate too, as its help says (a preset may set that
    one apart, e.g. the Staircase's Table 5 reddit core; ``--set embed_dropout=R`` still does)."""
    return {} if dropout is None else {"dropout": dropout, "embed_dropout": dropout}


def plan_run(request: TrainRequest) -> RunPlan:
    """Resolve ``request``: ``--resume`` continues the run in ``out`` (its model, data and settings, with the given
    training fields on top); ``--init-from`` starts a new run from a checkpoint's model, config and tokenizer;
    otherwise a preset is initialised afresh on a corpus or a task."""
    r = request
    model_flags: dict[str, Any] = dropout_fields(r.dropout)
    if "embed_dropout" in r.model_overrides:  # given apart from --dropout: kept
        model_flags.pop("embed_dropout", None)
    if r.mup_base_width is not None:
        model_flags["mup_base_width"] = r.mup_base_width
    overrides = {**r.model_overrides, **model_flags}
    if r.tokens is not None and "steps" in r.train_overrides:
        raise BlockloopError("--tokens sets the number of steps; give --tokens or --steps, not both")
    if r.distill_weight is not None and r.distill_from is None and not r.resume:  # a resume refuses it below
        raise BlockloopError("--distill-weight weighs the teacher's term; add --distill-from TEACHER or leave it out")
    if r.resume and r.init_from:
        raise BlockloopError("--resume continues the run in --out; --init-from starts a new one: give one of them")
    if (r.out / "model.safetensors").is_file():  # a run written here would nest inside (and break) that one
        run = r.out.parent.parent if r.out.parent.name == "checkpoints" else None
        fix = f"name its run, {run}, instead" if run is not None else "start a new run from it with --init-from"
        raise BlockloopError(f"--out {r.out} is a checkpoint directory, not a run folder; {fix}")
    if r.out.name == ckpt.checkpoint_root(Path()).name and ckpt.has_checkpoint(r.out.parent):
        # its checkpoints would nest in checkpoints/checkpoints, its log beside the step folders, apart from the run
        raise BlockloopError(f"--out {r.out} is the checkpoints folder of the run {r.out.parent}, not a run folder; "
                             f"name its run, {r.out.parent}, instead")
    if r.resume:
        if not r.out.exists():
            raise BlockloopError(f"--out {r.out} holds no run to resume; drop --resume to start one there")
        directory = ckpt.resolve_checkpoint(r.out)
        state = ckpt.read_json(directory / "train_state.json")
        if isinstance(state, dict) and "converted_from" in state:  # every conversion and export says so
            raise BlockloopError(f"{r.out} holds a model without training state (a converted or exported one); "
                                 "start a new run from it with --init-from")
        state = ckpt.read_train_state(directory)  # a damaged state is named as such, not taken for a conversion
        spec = from_fields(RunSpec, state["run"], f"{directory / 'train_state.json'}: run")
        spec = _moved_data(spec, r.data, r.task_dir)
        named = (("preset", r.preset), ("tokenizer", r.tokenizer), ("task", r.task), ("dropout", r.dropout),
                 ("mup_base_width", r.mup_base_width))
        clashes = _given(named, r.model_overrides)
        # A distilling run may name its teacher again once the checkpoint it pinned is gone (the teacher's run trained
        # on and removed it, or it moved); while it is there, another teacher would change the loss mid-run.
        saved = TrainConfig.saved_fields(state["train_config"])
        pinned = saved.get("distill_from")
        repin = pinned is not None and r.distill_from is not None
        if repin and Path(pinned).exists() and ckpt.resolve_checkpoint(Path(r.distill_from)).resolve() != Path(pinned):
            raise BlockloopError(f"--resume distils from the run's own teacher, {pinned}, which is still there; drop "
                                 "--distill-from (it names the teacher again only once that checkpoint is gone)")
        exits = (("early_exit", r.early_exit.exit_loss), ("exit_coefficient", r.early_exit.exit_coefficient),
                 ("exit_kd_weight", r.early_exit.exit_kd_weight), ("distill_from", None if repin else r.distill_from),
                 ("distill_weight", r.distill_weight))
        clashes += [name for name, value in exits if value is not None]
        clashes += ["objective"] if "objective" in r.train_overrides else []  # the loss; the rest is how it trains
        # the seed orders the data: the saved position in this epoch's shuffle would point into another order
        clashes += ["seed"] if r.train_overrides.get("seed", saved.get("seed")) != saved.get("seed") else []
        if clashes:
            raise BlockloopError(f"--resume continues the saved run with its own model, data, order and loss; drop "
                                 f"{_flags(clashes)}")
        # The model, config and tokenizer come from the run's own checkpoint, whatever it started from.
        source = dataclasses.replace(spec, init_from=str(directory))
        # The flags passed argparse's checks, so a value refused here is the file's.
        config = from_fields(TrainConfig, {**saved, **r.train_overrides}, f"{directory / 'train_state.json'}: train_config")
        if repin:
            config.distill_from = str(ckpt.resolve_checkpoint(Path(r.distill_from)).resolve())
        return RunPlan(spec, source, config, r.out, True, r.early_exit, r.tokens)
    if r.out.exists() and not r.out.is_dir():
        raise BlockloopError(f"--out {r.out} is a file; name a directory for the run")
    if ckpt.has_checkpoint(r.out):
        raise BlockloopError(f"{r.out} already holds a run; pass --resume to continue it or choose another --out")
    data = absolute_source(r.data) if r.data else None
    if r.init_from is not None:
        clashes = _given((("preset", r.preset), ("tokenizer", r.tokenizer), ("mup_base_width", r.mup_base_width)),
                         r.model_overrides)
        if clashes:
            raise BlockloopError(f"--init-from keeps the saved model and tokenizer; drop {_flags(clashes)}")
        spec = init_from_spec(r.init_from, data=data, task=r.task, task_dir=r.task_dir)
        if r.dropout is not None:  # how the saved model fine-tunes, not what it is
            spec = dataclasses.replace(spec, model_overrides=dropout_fields(r.dropout))
    elif r.task or r.task_dir:
        if r.data or r.tokenizer:
            raise BlockloopError("--task brings its own data and vocabulary; drop --data/--tokenizer")
        spec = RunSpec(preset=r.preset or "demo", model_overrides=overrides, **task_fields(r.task, r.task_dir))
    else:
        spec = RunSpec(
            preset=r.preset or "demo", data=data or "shakespeare", tokenizer=r.tokenizer or "byte",
            model_overrides=overrides,
        )
    config = TrainConfig(**r.train_overrides)
    if spec.task is not None and config.objective != "lm":
        raise BlockloopError(f"--objective {config.objective} scores a text's suffix; a task scores its labelled "
                             "positions: drop --objective")
    if r.distill_from is not None:
        # Pinned: the teacher's checkpoint as it is now, by absolute path, so a resume from elsewhere, or after the
        # teacher's run trained on, distils from the same teacher.
        teacher = ckpt.resolve_checkpoint(Path(r.distill_from)).resolve()
        config.distill_from, config.distill_weight = str(teacher), 1.0 if r.distill_weight is None else r.distill_weight
    return RunPlan(spec, spec, config, r.out, False, r.early_exit, r.tokens, fit_seq_len="seq_len" not in r.train_overrides)


def _moved_data(spec: RunSpec, data: str | None, task_dir: str | None) -> RunSpec:
    """``spec`` reading its data from where it is now: ``--data`` (a corpus run) or ``--task-dir`` (an imported
    task) name the new place of the same data, which the checkpoint's data fingerprint then confirms."""
    if spec.task is not None:
        if data is not None:
            raise BlockloopError(f"the run trains on task {spec.task}, not a corpus; drop --data (a moved task folder "
                                 "is named with --task-dir)")
        if task_dir is not None:
            return dataclasses.replace(spec, **task_fields(spec.task, task_dir))
        if spec.task_dir is not None and not Path(spec.task_dir).is_dir():
            raise BlockloopError(f"the run's task folder {spec.task_dir} is gone; if it moved, name it with --task-dir "
                                 "(the resume checks it holds the same task)")
        return spec
    if task_dir is not None:
        raise BlockloopError(f"the run trains on the corpus {spec.data}, not a task; drop --task-dir (a moved corpus "
                             "is named with --data)")
    if data is not None:
        return dataclasses.replace(spec, data=absolute_source(data))
    if not corpus_is_there(spec.data):
        raise BlockloopError(f"the run's corpus {spec.data} is gone; if it moved, name it with --data (the resume "
                             "checks it is the same text)")
    return spec


def _given(named: Sequence[tuple[str, Any]], model_overrides: dict[str, Any]) -> list[str]:
    """The fields among ``named`` (field, flag value) that were given, and ``set`` if ``--set`` was."""
    return [name for name, value in named if value is not None] + (["set"] if model_overrides else [])


def _flags(fields: Sequence[str]) -> str:
    """Fields as the flags that set them: ``--exit-coefficient, --set``."""
    return ", ".join(f"--{field.replace('_', '-')}" for field in fields)


def init_from_spec(
    checkpoint: str | Path, *, data: str | None = None, task: str | None = None, task_dir: str | None = None
) -> RunSpec:
    """A new run from ``checkpoint``'s model and tokenizer. Its data is the checkpoint's (corpus or task) unless
    ``data`` or a task is given."""
    directory = ckpt.resolve_checkpoint(Path(checkpoint))
    saved = ckpt.read_saved_state(directory).get("run", {})
    learned = saved.get("task") or saved.get("task_dir")
    if data is not None and learned:  # its tokenizer reads the task's words: say so, not which word of the text it lacks
        raise BlockloopError(f"the model learned task {learned} and reads its words, not text; leave --data out to "
                             "train it on its task")
    spec = RunSpec(
        preset=saved.get("preset", "demo"), data=data or saved.get("data", "shakespeare"),
        tokenizer=saved.get("tokenizer", "byte"), init_from=str(directory),
    )
    if task or task_dir:
        return dataclasses.replace(spec, **task_fields(task, task_dir))
    if data is None and saved.get("task") is not None:
        return dataclasses.replace(spec, task=saved["task"], task_dir=saved.get("task_dir"))
    return spec


def task_fields(task: str | None, task_dir: str | None) -> dict[str, str | None]:
    """RunSpec fields of a task run: the task's name, read from ``task_dir`` when one is given (a built-in task
    or an imported one), else a built-in task's name."""
    from blockloop.data.tasks import get_task, load_task

    if task_dir is not None:
        name = load_task(Path(task_dir)).name
        if task is not None and task != name:
            raise BlockloopError(f"{task_dir} holds task {name}, not {task}; drop --task or point --task-dir elsewhere")
    else:
        name = task
        get_task(name)  # an unknown task fails here, with the list of known ones
    resolved = str(Path(task_dir).resolve()) if task_dir else None
    return {"task": name, "task_dir": resolved, "data": f"task:{name}", "tokenizer": f"task:{name}"}


def clear_leftovers(plan: RunPlan) -> None:
    """Remove what interrupted runs left in ``plan.out``: temporary files always; on a fresh start (no complete
    checkpoint there, or :func:`plan_run` would have refused) also a partial first checkpoint and the old
    metrics, so the new run neither gets stuck on them nor appends to a log of steps it never took."""
    ckpt.discard_temporary(plan.out)
    if plan.resume:
        return
    leftovers = [p for p in (ckpt.checkpoint_root(plan.out), plan.out / "metrics.jsonl") if p.exists()]
    if leftovers:
        print(f"{plan.out} holds an interrupted run without a complete checkpoint; starting afresh "
              f"(removed {', '.join(p.name for p in leftovers)})", file=sys.stderr)
        shutil.rmtree(ckpt.checkpoint_root(plan.out), ignore_errors=True)
        (plan.out / "metrics.jsonl").unlink(missing_ok=True)


def apply_early_exit(config: ModelConfig, options: EarlyExit) -> ModelConfig:
    """``config`` with the early-exit loss fields set; only a looped (recursive) model has exits to train."""
    changes = options.changes()
    if not changes:
        return config
    if not set(changes) <= {f.name for f in dataclasses.fields(config)}:  # a model without loops has no exits
        raise BlockloopError(f"--early-exit and --exit-* train recursive models, not {config.family} models")
    # A weight the chosen loss never reads would be recorded as if it had trained the model (checked before the
    # config's own refusal, to name the flags).
    exit_loss = changes.get("exit_loss", config.exit_loss)
    unused = [flag for flag, given, read in (
        ("--exit-coefficient", options.exit_coefficient is not None, exit_loss == "aggressive"),
        ("--exit-kd-weight", bool(options.exit_kd_weight), exit_loss != "none"),  # 0 with no exit loss: consistent
    ) if given and not read]
    if unused:
        raise BlockloopError(f"{', '.join(unused)} weigh{'s' * (len(unused) == 1)} the early-exit loss, which this run "
                             f"does not use (exit loss {exit_loss}); add --early-exit "
                             f"{'aggressive' if '--exit-coefficient' in unused else 'weighted|aggressive'} or leave "
                             f"{'it' if len(unused) == 1 else 'them'} out")
    # Leaving a loss (--init-from) drops its weights: the distillation term with the exit loss, the coefficient with
    # the aggressive one (config.replace settles the fields a change leaves unread).
    return config.replace(**changes)


def steps_for_tokens(plan: RunPlan, trainer: Trainer) -> int:
    """The step count that trains ``--tokens`` in all: whole steps of this run's batch shape after the tokens a
    resumed run has already trained (which an earlier shape may have counted differently)."""
    budget, seen = int(plan.tokens), trainer.tokens_seen
    if not plan.resume:
        return max(1, budget // trainer.tokens_per_step)
    if budget < seen:
        raise BlockloopError(f"{plan.out} has already trained on {seen:,} tokens, past --tokens {plan.tokens:g}; "
                             f"give --tokens above {seen} to train further")
    return trainer.step + (budget - seen) // trainer.tokens_per_step


def start_training(plan: RunPlan, info: DistInfo = DistInfo()) -> tuple[PreparedRun, Trainer]:
    """Model, data and a trainer for ``plan`` (resumed from its last checkpoint on ``--resume``)."""
    config = plan.config
    if info.is_main:
        clear_leftovers(plan)
    run = prepare_run(plan.source, seed=config.seed, show_progress=info.is_main)
    # The early-exit fields are part of the model's config, saved with every checkpoint (also after --init-from).
    model_config = apply_early_exit(run.model_config, plan.early_exit)
    if model_config is not run.model_config:
        run.model_config = run.model.config = model_config
    if plan.fit_seq_len:
        config.seq_len = default_seq_len(model_config)
    train_seqs, val_seqs = sequences(run.splits, config.seq_len, run.tokenizer.start_id,
                                     spec_of(model_config).sequence_multiple(model_config))
    trainer = Trainer(
        run.model, run.model_config, run.tokenizer, train_seqs, val_seqs, config, plan.out,
        run_info=plan.spec.to_dict(), dist_info=info,
        loss_hook=build_distillation(config, run.model_config, run.tokenizer, config.resolved_device()),
        data_fingerprint=data_fingerprint(run.splits),
    )
    if plan.resume:
        trainer.resume(plan.out)
    if plan.tokens is not None:
        config.steps = steps_for_tokens(plan, trainer)
    if config.steps < config.warmup_steps and trainer.step < config.steps and info.is_main:
        # a note, not an error: tiny runs do this on purpose
        length = f"--tokens {plan.tokens:g} ({config.steps} steps)" if plan.tokens is not None else f"--steps {config.steps}"
        print(f"warning: {length} ends inside the {config.warmup_steps}-step warm-up: the learning rate peaks at "
              f"{config.lr * config.steps / config.warmup_steps:.3g}, not --lr {config.lr:g}; lower --warmup-steps",
              file=sys.stderr)
    return run, trainer
