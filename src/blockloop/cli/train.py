"""``blockloop train``: flags -> :class:`blockloop.train.setup.TrainRequest`; the library decides what they mean."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from blockloop.cli.common import (
    add_no_progress,
    device,
    fraction,
    integer,
    nonempty,
    nonnegative_float,
    nonnegative_int,
    number,
    parse_overrides,
    positive_float,
    positive_int,
    refuse_flags,
)
from blockloop.errors import BlockloopError

HELP = "train a model (single process, or under torchrun for DDP/FSDP)"
DESCRIPTION = ("Train a model from a preset on a built-in corpus or your own text. Flags left out take the defaults "
               "shown; with --resume they come from the checkpoint instead.")

# Flags that are TrainConfig fields of the same name.
TRAIN_FLAGS = (
    "steps", "batch_size", "grad_accum", "seq_len", "lr", "min_lr_ratio", "warmup_steps", "schedule", "weight_decay",
    "decay_embeddings", "grad_clip", "seed", "eval_interval", "eval_batches", "log_interval", "ckpt_interval",
    "device", "precision", "compile", "distributed", "objective",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from blockloop.choices import DISTRIBUTED, EXIT_LOSSES, OBJECTIVES, PRECISIONS, SCHEDULES
    from blockloop.data.corpora import BUILTIN_CORPORA
    from blockloop.train.config import TrainConfig

    d = TrainConfig()
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", type=nonempty, help="model preset (see `blockloop presets`; default: demo)")
    g.add_argument(
        "--data", type=nonempty,
        help=f"built-in corpus ({', '.join(BUILTIN_CORPORA)}) or a path: text file, directory of .txt, .jsonl with a "
        "'text' field, or bytes:PATH for raw bytes (default: shakespeare)",
    )
    g.add_argument(
        "--tokenizer", type=nonempty,
        help="byte, gpt2, neox, smollm2, bpe[:VOCAB] (trained on --data and saved with the run) or a tokenizer.json path "
        "(default: byte)",
    )
    g.add_argument(
        "--task", metavar="NAME", type=nonempty,
        help="train on a labelled-position task instead of text (algorithm-3, algorithm-5, random-walk, or NAME:LENGTH "
        "for shorter or longer sequences); its vocabulary becomes the tokenizer and validation reports the task error",
    )
    g.add_argument(
        "--task-dir", metavar="DIR", type=nonempty,
        help="the task dataset to use, written by `blockloop tasks make` or `tasks import` (default, with --task: "
        "generated with seed 0 into the cache)",
    )
    g.add_argument("--dropout", type=number(0, 1, high_open=True),
                   help="dropout on embeddings, attention and residuals (default: the preset's, or --init-from RUN's)")
    g.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="override a field of the preset's model config, e.g. --set embedder=cls --set prefix_len=1 (repeatable; "
        "see the config dataclass of the preset's family in blockloop/families/)",
    )
    g.add_argument(
        "--objective", choices=OBJECTIVES,
        help="lm: each family's own pretraining objective (next token; block partitions; span corruption); "
        "prefix_lm: score only the suffix after a breakpoint drawn per batch (default: lm)",
    )
    g.add_argument(
        "--init-from", metavar="RUN", type=nonempty,
        help="start a new run (fresh optimizer and schedule) from the model, config and tokenizer of RUN: "
        "fine-tuning, the PrefixLM phase after pretraining, or uptraining a model made by `blockloop convert`; "
        "the data is RUN's unless --data is given; --dropout may change how it fine-tunes",
    )
    e = p.add_argument_group("distillation and early exit of looped models (RRT section 3.7, appendices L, M)")
    e.add_argument("--distill-from", metavar="RUN", type=nonempty,
                   help="add forward-KL distillation from this frozen teacher (e.g. the model a looped one was "
                   "converted from); the teacher is never saved with the student. With --resume: the distilling run's teacher "
                   "named again, when its pinned checkpoint is gone")
    e.add_argument("--distill-weight", type=positive_float, help="weight of the KL term (default: 1.0)")
    e.add_argument("--early-exit", choices=EXIT_LOSSES,
                   help="train every loop's exit: weighted (alpha_i = i / sum i) or aggressive (intermediate loops "
                   "x --exit-coefficient, final x 1); looped models only")
    e.add_argument("--exit-coefficient", type=nonnegative_float, help="aggressive strategy: intermediate-loop weight (default: 0.1)")
    e.add_argument("--exit-kd-weight", type=nonnegative_float,
                   help="add KD from the detached final loop to each intermediate loop, with this weight (default: 0)")
    g.add_argument(
        "--mup-base-width", type=positive_int,
        help="muP width scaling with base width d0: hidden-matrix LR x d0/d, logits x sqrt(d0/d) (paper: 64)",
    )
    g = p.add_argument_group("length of training")
    g.add_argument("--steps", type=positive_int, help=f"optimizer steps (default: {d.steps})")
    # at most 1e15 tokens, about 50x the largest published pretraining runs: a larger count is a typo
    g.add_argument("--tokens", type=number(1, 1e15), help="train for this many tokens instead of --steps (e.g. 2e6)")
    g = p.add_argument_group("batch and optimizer")
    g.add_argument("--batch-size", type=positive_int, help=f"sequences per micro-batch per process; a step takes --grad-accum of them (default: {d.batch_size})")
    g.add_argument("--grad-accum", type=positive_int, help=f"micro-batches accumulated per step (default: {d.grad_accum})")
    g.add_argument("--seq-len", type=positive_int, help=f"tokens per training sequence, at most the model context (default: {d.seq_len}, or the "
                   "longest whole number of blocks or chunks the model context holds when that is shorter)")
    g.add_argument("--lr", type=positive_float, help=f"peak learning rate (default: {d.lr})")
    g.add_argument("--min-lr-ratio", type=fraction, help=f"final LR as a fraction of the peak (default: {d.min_lr_ratio})")
    g.add_argument("--warmup-steps", type=nonnegative_int, help=f"linear warm-up steps (default: {d.warmup_steps})")
    g.add_argument("--schedule", choices=SCHEDULES, help=f"decay after warm-up (default: {d.schedule})")
    g.add_argument("--weight-decay", type=nonnegative_float, help=f"AdamW decay on matrices (default: {d.weight_decay})")
    g.add_argument("--decay-embeddings", action="store_const", const=True, help="also decay embedding tables")
    g.add_argument("--grad-clip", type=nonnegative_float, help=f"clip the gradient norm to this; 0 disables (default: {d.grad_clip})")
    g.add_argument("--seed", type=integer(0, 2**32 - 1), help=f"seed for initialisation, data order and dropout (default: {d.seed})")
    g = p.add_argument_group("evaluation, logging and checkpoints")
    g.add_argument("--eval-interval", type=positive_int, help=f"validate every N steps (default: {d.eval_interval})")
    g.add_argument("--eval-batches", type=positive_int, help=f"validation batches per evaluation (default: {d.eval_batches})")
    g.add_argument("--log-interval", type=positive_int, help=f"log every N steps (default: {d.log_interval})")
    g.add_argument("--ckpt-interval", type=positive_int, help=f"checkpoint every N steps and at the end (default: {d.ckpt_interval})")
    g.add_argument("--out", type=nonempty, default="runs/latest", help="run directory for checkpoints and metrics.jsonl (default: runs/latest)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint, with the run's own model, data and loss "
                   "(give none of the flags that choose them, even with the same value, except --data or --task-dir "
                   "for the new place of a moved corpus or task folder); training flags such as --steps or --lr may "
                   "change")
    add_no_progress(g)
    g = p.add_argument_group("hardware")
    g.add_argument("--device", type=device, help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    g.add_argument("--precision", choices=PRECISIONS, help="auto = bf16 autocast on CUDA, fp32 on CPU")
    g.add_argument("--compile", action="store_const", const=True, help="torch.compile the model")
    g.add_argument("--distributed", choices=DISTRIBUTED, help="strategy under torchrun (default: ddp)")


def run(args: argparse.Namespace) -> int:
    from blockloop.files import run_lock

    # One process writes a run at a time; under torchrun, rank 0 holds the lock for all ranks. (--resume of a run
    # that is not there fails in plan_run, without creating it.)
    out = Path(args.out)
    with run_lock(out, enabled=os.environ.get("RANK", "0") == "0" and (out.exists() or not args.resume)):
        return train(args)


def train(args: argparse.Namespace) -> int:
    from blockloop.files import held_by_this_job
    from blockloop.train.distributed import init_distributed, on_any_rank, shutdown
    from blockloop.train.setup import EarlyExit, TrainRequest, plan_run, start_training

    if args.schedule == "constant" and args.min_lr_ratio is not None:
        refuse_flags(["min_lr_ratio"], "--schedule constant (the learning rate does not decay)")
    given = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k) is not None}
    plan = plan_run(TrainRequest(
        out=Path(args.out), resume=args.resume, init_from=args.init_from, preset=args.preset, data=args.data,
        tokenizer=args.tokenizer, task=args.task, task_dir=args.task_dir, model_overrides=parse_overrides(args.set),
        dropout=args.dropout, mup_base_width=args.mup_base_width, train_overrides=given,
        tokens=args.tokens, early_exit=EarlyExit(args.early_exit, args.exit_coefficient, args.exit_kd_weight),
        distill_from=args.distill_from, distill_weight=args.distill_weight,
    ))
    info = init_distributed(plan.config.resolved_device())
    if args.distributed is not None and not info.enabled:
        print(f"warning: --distributed {args.distributed} applies across torchrun's processes; this one process "
              "trains the whole model (launch with torchrun --nproc-per-node N to shard it)", file=sys.stderr)
    try:
        # Rank 0 took the run's lock before the group formed: a rank that cannot read it writes somewhere else.
        if on_any_rank(not info.is_main and held_by_this_job(plan.out) is False, info):
            raise BlockloopError(f"not every rank sees the run folder {plan.out} that rank 0 locked (a relative --out "
                                 "from other working directories, or a folder not on a shared filesystem); give every "
                                 "rank the same --out on a filesystem they share")
        run, trainer = start_training(plan, info)
        if trainer.step > trainer.config.steps:
            raise BlockloopError(f"{plan.out} is already at step {trainer.step}, past --steps {trainer.config.steps}; "
                                 f"give --steps above {trainer.step} to train further")
        if trainer.step == trainer.config.steps:  # a finished run resumed (again): nothing to do, nothing to fail
            if info.is_main:
                budget = "--tokens" if plan.tokens is not None else "--steps"
                print(f"{plan.out} is already at step {trainer.step} of {trainer.config.steps}; nothing to train "
                      f"(give a larger {budget} to train further)")
            return 0
        if info.is_main:
            config = trainer.config
            exit_loss = getattr(run.model_config, "exit_loss", "none")
            exit_kd = getattr(run.model_config, "exit_kd_weight", 0.0)  # kept from --init-from's source too: say so
            coefficient = getattr(run.model_config, "exit_coefficient", None)  # the same
            teacher = config.distill_from
            print(
                f"training {run.model_config.name} ({run.model.num_parameters() / 1e6:.2f}M parameters"
                f"{f', {exit_loss} early-exit loss' if exit_loss != 'none' else ''}"
                f"{f' (coefficient {coefficient:g})' if exit_loss == 'aggressive' else ''}"
                f"{f' with exit distillation weight {exit_kd:g}' if exit_loss != 'none' and exit_kd else ''}"
                f"{f', distilling from {teacher}' if teacher else ''}) on "
                f"{plan.spec.data} with the {run.tokenizer.name} tokenizer ({run.tokenizer.vocab_size} ids): "
                f"{len(trainer.train_data)} train / "
                f"{len(trainer.val_data)} val sequences of {config.seq_len} tokens; step {trainer.step} of "
                f"{config.steps} on {trainer.device}"
            )
        metrics = trainer.fit()
        if info.is_main:
            error = f", val task error {metrics['val_error']:.2%}" if "val_error" in metrics else ""
            print(f"done: step {trainer.step}, val loss {metrics.get('val_loss', float('nan')):.4f}{error}; "
                  f"checkpoint in {plan.out}")
    finally:
        shutdown(info)
    return 0
