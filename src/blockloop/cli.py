"""``blockloop <verb>``: train, eval, generate, presets, flops, bench, info, demo.

Each verb is a thin layer over the library. User mistakes surface as :class:`BlockloopError` and are
printed as one line on stderr with exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from blockloop.errors import BlockloopError

if TYPE_CHECKING:
    from torch import nn

    from blockloop.data.loader import PackedSequences
    from blockloop.train.run import PreparedRun

EXIT_USER_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except BlockloopError as exc:
        print(f"blockloop {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"blockloop {args.command}: interrupted; the last checkpoint written is kept", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blockloop",
        description="Train, evaluate and sample language models that reuse computation across depth and time.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_eval(sub)
    _add_generate(sub)
    _add_convert(sub)
    _add_tasks(sub)
    p = sub.add_parser("presets", help="list the named model presets with parameter counts")
    p.set_defaults(handler=cmd_presets)
    _add_flops(sub)
    _add_bench(sub)
    p = sub.add_parser("info", help="show the environment, or a checkpoint's config and training state")
    p.add_argument("checkpoint", nargs="?", help="run directory or checkpoint directory (omit for the environment)")
    p.set_defaults(handler=cmd_info)
    p = sub.add_parser("demo", help="train every model family briefly on Shakespeare and compare them (CPU, minutes)")
    p.add_argument("--out", default="runs/demo", help="where the demo writes its runs (default: runs/demo)")
    p.add_argument("--steps", type=int, default=None, help="training steps per model (default: the demo's own)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.set_defaults(handler=cmd_demo)
    return parser


# ---------------------------------------------------------------------- train
def _add_train(sub: argparse._SubParsersAction) -> None:
    from blockloop.data.corpora import BUILTIN_CORPORA
    from blockloop.train.trainer import TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train a model (single process, or under torchrun for DDP/FSDP)",
        description="Train a model from a preset on a built-in corpus or your own text. Flags left out take the "
        "defaults shown; with --resume they come from the checkpoint instead.",
    )
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", help="model preset (see `blockloop presets`; default: demo)")
    g.add_argument(
        "--data",
        help=f"built-in corpus ({', '.join(BUILTIN_CORPORA)}) or a path: text file, directory of .txt, .jsonl with a "
        "'text' field, or bytes:PATH for raw bytes (default: shakespeare)",
    )
    g.add_argument(
        "--tokenizer",
        help="byte, gpt2, neox, bpe[:VOCAB] (trained on --data and saved with the run) or a tokenizer.json path "
        "(default: byte)",
    )
    g.add_argument(
        "--task", metavar="NAME",
        help="train on a labelled-position task instead of text (algorithm-3, algorithm-5, random-walk, or NAME:LENGTH "
        "for shorter sequences); its vocabulary becomes the tokenizer and validation reports the task error",
    )
    g.add_argument(
        "--task-dir", metavar="DIR",
        help="the task dataset to use, written by `blockloop tasks make` (default: generated with seed 0 into the cache)",
    )
    g.add_argument("--dropout", type=float, help="dropout on embeddings, attention and residuals (default: preset's)")
    g.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="override a field of the preset's model config, e.g. --set embedder=cls --set prefix_len=1 (repeatable; "
        "see the config dataclasses in blockloop/config.py)",
    )
    g.add_argument(
        "--objective", choices=["lm", "prefix_lm"],
        help="lm: each family's own pretraining objective (next token; block partitions; span corruption); "
        "prefix_lm: score only the suffix after a breakpoint drawn per batch (default: lm)",
    )
    g.add_argument(
        "--init-from", metavar="RUN",
        help="start a new run (fresh optimizer and schedule) from the model, config and tokenizer of RUN: "
        "fine-tuning, the PrefixLM phase after pretraining, or uptraining a model made by `blockloop convert`; "
        "the data is RUN's unless --data is given",
    )
    _add_recursive_train_flags(p)
    g.add_argument(
        "--mup-base-width", type=int,
        help="muP width scaling with base width d0: hidden-matrix LR x d0/d, logits x sqrt(d0/d) (paper: 64)",
    )
    g = p.add_argument_group("length of training")
    g.add_argument("--steps", type=int, help=f"optimizer steps (default: {d.steps})")
    g.add_argument("--tokens", type=float, help="train for this many tokens instead of --steps (e.g. 2e6)")
    g = p.add_argument_group("batch and optimizer")
    g.add_argument("--batch-size", type=int, help=f"sequences per step per process (default: {d.batch_size})")
    g.add_argument("--grad-accum", type=int, help=f"micro-batches accumulated per step (default: {d.grad_accum})")
    g.add_argument("--seq-len", type=int, help=f"tokens per training sequence, at most the model context (default: {d.seq_len})")
    g.add_argument("--lr", type=float, help=f"peak learning rate (default: {d.lr})")
    g.add_argument("--min-lr-ratio", type=float, help=f"final LR as a fraction of the peak (default: {d.min_lr_ratio})")
    g.add_argument("--warmup-steps", type=int, help=f"linear warm-up steps (default: {d.warmup_steps})")
    g.add_argument("--schedule", choices=["cosine", "linear", "constant"], help=f"decay after warm-up (default: {d.schedule})")
    g.add_argument("--weight-decay", type=float, help=f"AdamW decay on matrices (default: {d.weight_decay})")
    g.add_argument("--decay-embeddings", action="store_const", const=True, help="also decay embedding tables")
    g.add_argument("--grad-clip", type=float, help=f"clip the gradient norm to this; 0 disables (default: {d.grad_clip})")
    g.add_argument("--seed", type=int, help=f"seed for initialisation, data order and dropout (default: {d.seed})")
    g = p.add_argument_group("evaluation, logging and checkpoints")
    g.add_argument("--eval-interval", type=int, help=f"validate every N steps (default: {d.eval_interval})")
    g.add_argument("--eval-batches", type=int, help=f"validation batches per evaluation (default: {d.eval_batches})")
    g.add_argument("--log-interval", type=int, help=f"log every N steps (default: {d.log_interval})")
    g.add_argument("--ckpt-interval", type=int, help=f"checkpoint every N steps and at the end (default: {d.ckpt_interval})")
    g.add_argument("--out", default="runs/latest", help="run directory for checkpoints and metrics.jsonl (default: runs/latest)")
    g.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    g = p.add_argument_group("hardware")
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16"], help="auto = bf16 autocast on CUDA, fp32 on CPU")
    g.add_argument("--compile", action="store_const", const=True, help="torch.compile the model")
    g.add_argument("--distributed", choices=["ddp", "fsdp"], help="strategy under torchrun (default: ddp)")
    p.set_defaults(handler=cmd_train)


TRAIN_FLAGS = (
    "steps", "batch_size", "grad_accum", "seq_len", "lr", "min_lr_ratio", "warmup_steps", "schedule", "weight_decay",
    "decay_embeddings", "grad_clip", "seed", "eval_interval", "eval_batches", "log_interval", "ckpt_interval",
    "device", "precision", "compile", "distributed", "objective",
)
MODEL_FLAGS = ("dropout", "mup_base_width")


def cmd_train(args: argparse.Namespace) -> int:
    from blockloop.train import checkpoint as ckpt
    from blockloop.train.distill import build_distillation
    from blockloop.train.distributed import init_distributed, shutdown
    from blockloop.train.run import RunSpec, prepare_run, sequences
    from blockloop.train.trainer import TrainConfig, Trainer

    out = Path(args.out)
    given = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k) is not None}
    if args.resume and args.init_from:
        raise BlockloopError("--resume continues the run in --out; --init-from starts a new one: give one of them")
    overrides = _parse_overrides(args.set)
    overrides.update({k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None})
    if args.resume:
        directory = ckpt.resolve_checkpoint(out)
        state = ckpt.read_json(directory / "train_state.json")
        spec = RunSpec(**state["run"])
        clashes = [f for f in ("preset", "data", "tokenizer", "task", "task_dir", *MODEL_FLAGS) if getattr(args, f) is not None]
        clashes += ["set"] if args.set else []
        clashes += [f for f in ("early_exit", "exit_coefficient", "exit_kd_weight", "distill_from") if getattr(args, f) is not None]
        if clashes:
            raise BlockloopError(f"--resume continues the saved run; drop --{', --'.join(f.replace('_', '-') for f in clashes)}")
        # The model, config and tokenizer come from the run's own checkpoint, whatever it started from.
        source = dataclasses.replace(spec, init_from=str(directory))
        config = TrainConfig(**{**state["train_config"], **given})
    else:
        if ckpt.checkpoint_root(out).exists():
            raise BlockloopError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
        if args.init_from is not None:
            if args.preset or args.tokenizer or overrides:
                raise BlockloopError(
                    "--init-from keeps the saved model and tokenizer; drop --preset/--tokenizer/--set/--dropout/--mup-base-width"
                )
            directory = ckpt.resolve_checkpoint(Path(args.init_from))
            saved = ckpt.read_json(directory / "train_state.json").get("run", {}) if (directory / "train_state.json").is_file() else {}
            spec = RunSpec(
                preset=saved.get("preset", "demo"), data=args.data or saved.get("data", "shakespeare"),
                tokenizer=saved.get("tokenizer", "byte"), init_from=str(directory),
            )
            if args.task or args.task_dir:
                spec = dataclasses.replace(spec, **_task_fields(args))
            elif args.data is None and saved.get("task") is not None:
                spec = dataclasses.replace(spec, task=saved["task"], task_dir=saved.get("task_dir"))
        elif args.task or args.task_dir:
            if args.data or args.tokenizer:
                raise BlockloopError("--task brings its own data and vocabulary; drop --data/--tokenizer")
            spec = RunSpec(preset=args.preset or "demo", model_overrides=overrides, **_task_fields(args))
        else:
            spec = RunSpec(
                preset=args.preset or "demo", data=args.data or "shakespeare", tokenizer=args.tokenizer or "byte",
                model_overrides=overrides,
            )
        source = spec
        config = TrainConfig(**given)
        if args.distill_from is not None:
            config.extra.update(distill_from=args.distill_from, distill_weight=args.distill_weight)
    config.progress = not args.no_progress
    info = init_distributed(config.resolved_device())
    try:
        run = prepare_run(source, seed=config.seed, show_progress=info.is_main)
        _apply_early_exit(run, args)
        if args.tokens is not None:
            per_step = config.batch_size * config.grad_accum * config.seq_len * info.world_size
            config.steps = max(1, int(args.tokens // per_step))
        train_seqs, val_seqs = sequences(run.splits, config.seq_len)
        trainer = Trainer(
            run.model, run.model_config, run.tokenizer, train_seqs, val_seqs, config, out,
            run_info=spec.to_dict(), dist_info=info,
            loss_hook=build_distillation(config.extra, run.model_config, config.resolved_device()),
        )
        if args.resume:
            trainer.resume(out)
        if info.is_main:
            n = run.model.num_parameters()
            print(
                f"training {run.model_config.name} ({n / 1e6:.2f}M parameters) on {spec.data} with the {run.tokenizer.name} tokenizer: "
                f"{len(train_seqs)} train / {len(val_seqs)} val sequences of {config.seq_len} tokens; step {trainer.step} "
                f"of {config.steps} on {trainer.device}"
            )
        metrics = trainer.fit()
        if info.is_main:
            error = f", val task error {metrics['val_error']:.2%}" if "val_error" in metrics else ""
            print(f"done: step {trainer.step}, val loss {metrics.get('val_loss', float('nan')):.4f}{error}; checkpoint in {out}")
    finally:
        shutdown(info)
    return 0


def _task_fields(args: argparse.Namespace) -> dict[str, str | None]:
    """RunSpec fields of ``--task``/``--task-dir``: the task's name (read from the directory if only that is given)."""
    from blockloop.data.tasks import get_task, load_task

    name = args.task
    if name is None:
        name = load_task(Path(args.task_dir)).name
    get_task(name)  # an unknown task fails here, with the list of known ones
    task_dir = str(Path(args.task_dir).resolve()) if args.task_dir else None
    return {"task": name, "task_dir": task_dir, "data": f"task:{name}", "tokenizer": f"task:{name}"}


# ----------------------------------------------------------------------- eval
def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a checkpoint on a dataset split")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    p.add_argument("--data", help="corpus name or path (default: the data the run trained on)")
    p.add_argument(
        "--split", choices=["train", "val", "valid", "test"],
        help="which split to score: train or val of a corpus; train, valid (= val) or test of a task (default: val)",
    )
    p.add_argument(
        "--task", metavar="NAME",
        help="score the task error on this labelled-position task (default: the task the run trained on, if any); "
        "a NAME:LENGTH variant tests other sequence lengths",
    )
    p.add_argument("--task-dir", metavar="DIR", help="the task dataset to score (default: the run's, or generated into the cache)")
    p.add_argument("--seq-len", type=int, help="window length (default: the run's training --seq-len)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default: 8)")
    p.add_argument("--max-batches", type=int, help="stop after this many batches (default: the whole split)")
    p.add_argument(
        "--objective", choices=["lm", "prefix_lm"],
        help="what to score: lm or prefix_lm (the suffix after a breakpoint; default: the run's training objective)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.add_argument(
        "--per-loop", action="store_true",
        help="recursive models: static early exit after every loop - loss, next-token accuracy, agreement with "
        "the final loop and the oracle-exit share per loop",
    )
    p.set_defaults(handler=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from blockloop.data.dataset import prepare_tokens
    from blockloop.data.loader import PackedSequences
    from blockloop.train.evaluate import evaluate
    from blockloop.train.run import load_trained

    if args.batch_size < 1:
        raise BlockloopError(f"--batch-size must be at least 1, got {args.batch_size}")
    device = _device(args.device)
    trained = load_trained(args.checkpoint, device)
    run = trained.state.get("run", {})
    if args.task or args.task_dir or (args.data is None and (run.get("task") or run.get("task_dir"))):
        return _eval_task(args, trained, device)
    if args.split == "test":
        raise BlockloopError("a corpus has train and val splits only; --split test is for tasks (--task)")
    args.split = "val" if args.split in (None, "valid") else args.split
    data = args.data or run.get("data")
    if data is None:
        raise BlockloopError("the checkpoint does not record its data; pass --data")
    seq_len = args.seq_len or trained.state.get("train_config", {}).get("seq_len") or trained.config.context_length
    if seq_len > trained.config.context_length:
        raise BlockloopError(f"--seq-len {seq_len} exceeds the model context of {trained.config.context_length}")
    if seq_len % getattr(trained.config, "block_len", 1):
        raise BlockloopError(f"--seq-len {seq_len} is not a multiple of the model's block length {trained.config.block_len}")
    objective = args.objective or trained.state.get("train_config", {}).get("objective", "lm")
    splits = prepare_tokens(data, trained.tokenizer)
    seqs = PackedSequences(getattr(splits, args.split), seq_len)
    if args.per_loop:
        return _eval_per_loop(trained.model, seqs, args, device, data)
    metrics = evaluate(
        trained.model, seqs, batch_size=args.batch_size, max_batches=args.max_batches,
        byte_lengths=trained.tokenizer.token_byte_lengths(), device=device, objective=objective,
    )
    if args.json:
        print(json.dumps({"data": data, "split": args.split, "objective": objective, **metrics}))
    else:
        parts = [f"loss {metrics['loss']:.4f}", f"perplexity {metrics['perplexity']:.3f}"]
        if "bits_per_byte" in metrics:
            parts.append(f"bits/byte {metrics['bits_per_byte']:.4f}")
        print(f"{data} {args.split} {objective} ({int(metrics['tokens'])} tokens): " + ", ".join(parts))
    return 0


def _eval_task(args: argparse.Namespace, trained: TrainedModel, device: str) -> int:  # noqa: F821
    """``eval`` on a labelled-position task: loss and argmax error over the labelled positions of one split."""
    from blockloop.data.tasks import get_task, open_task
    from blockloop.train.evaluate import evaluate
    from blockloop.train.run import check_task_vocabulary, task_sequences

    if args.data:
        raise BlockloopError("--data names a corpus and --task a task; give one of them")
    run = trained.state.get("run", {})
    if args.task or args.task_dir:
        name, directory = args.task, args.task_dir
    else:
        name, directory = run.get("task"), run.get("task_dir")
    if name is not None:  # a wrong model fails before the task is generated
        check_task_vocabulary(trained.tokenizer, name, get_task(name).vocab)
    data = open_task(name, directory)
    check_task_vocabulary(trained.tokenizer, data.name, data.vocab)
    split = {None: "valid", "val": "valid"}.get(args.split, args.split)
    seq_len = args.seq_len or trained.state.get("train_config", {}).get("seq_len") or trained.config.context_length
    if seq_len > trained.config.context_length:
        raise BlockloopError(f"--seq-len {seq_len} exceeds the model context of {trained.config.context_length}")
    metrics = evaluate(
        trained.model, task_sequences(data, split, seq_len), batch_size=args.batch_size,
        max_batches=args.max_batches, device=device,
    )
    if args.json:
        print(json.dumps({"task": data.name, "split": split, **metrics}))
    else:
        print(
            f"{data.name} {split} ({int(metrics['tokens'])} labelled positions): loss {metrics['loss']:.4f}, "
            f"task error {metrics['error']:.2%}"
        )
    return 0


# ------------------------------------------------------------------- generate
def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="print a continuation of --prompt from a checkpoint")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument(
        "--max-new-tokens", type=int, help="tokens to generate at most (default: 200, or what fits in the model context)"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, help="sample only among the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample only from the smallest set with this total probability")
    p.add_argument("--num-samples", type=int, default=1, help="independent continuations, generated as one batch")
    p.add_argument("--seed", type=int, help="seed for sampling (same seed, same text)")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.set_defaults(handler=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from blockloop.serve.generate import generate
    from blockloop.train.run import load_trained

    if args.num_samples < 1:
        raise BlockloopError(f"--num-samples must be at least 1, got {args.num_samples}")
    trained = load_trained(args.checkpoint, _device(args.device))
    tok = trained.tokenizer
    prompt = tok.encode(args.prompt)
    max_new = args.max_new_tokens
    if max_new is None:
        max_new = min(200, trained.config.context_length - len(prompt))
        if max_new < 1:
            raise BlockloopError(
                f"prompt of {len(prompt)} tokens fills the model context of {trained.config.context_length}; shorten it"
            )
    kwargs = dict(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        eos_id=None if args.no_stop else tok.eos_id, seed=args.seed,
    )
    try:
        if args.num_samples == 1:
            # Stream: print each token's text as soon as it decodes to whole characters.
            pending: list[int] = []
            sys.stdout.write(args.prompt)

            def on_token(row: int, token: int) -> None:
                pending.append(token)
                text = tok.decode(pending)
                if not text.endswith("\ufffd"):
                    sys.stdout.write(text)
                    sys.stdout.flush()
                    pending.clear()

            generate(trained.model, [prompt], max_new, on_token=on_token, **kwargs)
            sys.stdout.write(tok.decode(pending) + "\n")
        else:
            outs = generate(trained.model, [prompt] * args.num_samples, max_new, **kwargs)
            for i, out in enumerate(outs):
                print(f"--- sample {i + 1}\n{args.prompt}{tok.decode(out)}")
    except ValueError as exc:  # bad sampling parameters
        raise BlockloopError(str(exc)) from exc
    return 0


# -------------------------------------------------------------------- convert
def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="turn a trained model into another family for uptraining (then `train --init-from`); import or "
        "export Hugging Face models",
        description="Initialise a structured model from a trained vanilla one and write it as a checkpoint; "
        "continue with `blockloop train --init-from OUT`. --from-hf imports a Hugging Face causal LM (Llama, "
        "Gemma, Gemma-3, GPT-NeoX, GPT-2) as a checkpoint; --to hf exports a vanilla checkpoint to a Hugging Face folder.",
    )
    p.add_argument("--to", choices=["block", "recursive", "hf"],
                   help="target: block (Block Transformer), recursive (Relaxed Recursive) or hf (Hugging Face folder)")
    p.add_argument("--checkpoint", help="run directory or checkpoint of a trained vanilla model (with --to)")
    p.add_argument(
        "--from-hf", metavar="PATH",
        help="import a Hugging Face model folder (config.json + safetensors, or a GGUF with --gguf-file), or "
        "'smollm2' to fetch and import the built-in SmolLM2-135M-Instruct",
    )
    p.add_argument("--gguf-file", metavar="NAME", help="--from-hf: the .gguf file inside PATH to read")
    p.add_argument(
        "--tokenizer", help="--from-hf: tokenizer to save with the model (default: the source's own tokenizer)"
    )
    p.add_argument("--out", required=True, help="directory to write the converted checkpoint to")
    p.add_argument("--block-len", type=int, default=4, help="block: tokens per block L_B (default: 4)")
    p.add_argument("--prefix-len", type=int, default=None,
                   help="block: prefix tokens of the token decoder (default: 2); recursive: learned prefix key/values "
                   "per depth position with --relax prefix (default: 0)")
    _add_recursive_convert_flags(p)
    p.set_defaults(handler=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from blockloop.convert import vanilla_to_block
    from blockloop.train import checkpoint as ckpt
    from blockloop.train.run import load_trained

    if (args.from_hf is None) == (args.to is None):
        raise BlockloopError("give either --from-hf PATH (import) or --to block|recursive|hf --checkpoint RUN (convert/export)")
    if args.from_hf is not None:
        return _convert_from_hf(args)
    if args.checkpoint is None:
        raise BlockloopError(f"--to {args.to} needs --checkpoint RUN, the trained model to convert")
    if args.to == "hf":
        return _convert_to_hf(args)
    if args.to == "recursive":
        return _convert_recursive(args)
    prefix_len = 2 if args.prefix_len is None else args.prefix_len
    if args.block_len < 1 or prefix_len < 1:
        raise BlockloopError("--block-len and --prefix-len must be at least 1")
    out = Path(args.out)
    if (out / "model.safetensors").exists():
        raise BlockloopError(f"{out} already holds a model; choose another --out")
    source = load_trained(args.checkpoint)
    model = vanilla_to_block(
        source.model, block_len=args.block_len, prefix_len=prefix_len, pad_id=source.tokenizer.eos_id
    )
    out.mkdir(parents=True, exist_ok=True)
    ckpt.save_model_files(out, model, model.config)
    source.tokenizer.save(out)
    ckpt.write_json_atomic(
        out / "train_state.json", {"step": 0, "run": source.state.get("run", {}), "converted_from": str(source.directory)}
    )
    print(
        f"wrote {model.config.name} ({model.num_parameters() / 1e6:.2f}M parameters, {model.config.summary()}) to {out}; "
        f"uptrain with: blockloop train --init-from {out} --out RUN"
    )
    return 0


def _convert_from_hf(args: argparse.Namespace) -> int:
    from blockloop.convert.hf_checkpoint import import_checkpoint

    model, tokenizer = import_checkpoint(args.from_hf, Path(args.out), gguf_file=args.gguf_file, tokenizer=args.tokenizer)
    print(
        f"wrote {model.config.name} ({model.num_parameters() / 1e6:.2f}M parameters, {model.config.summary()}, "
        f"tokenizer {tokenizer.name}) to {args.out}; try: blockloop generate --checkpoint {args.out} --prompt TEXT"
    )
    return 0


# ------------------------------------------------- recursive transformers (issue 3)
def _add_recursive_convert_flags(p: argparse.ArgumentParser) -> None:
    from blockloop.config import TYING_STRATEGIES
    from blockloop.convert.to_recursive import LOOP_INITS, LORA_INITS

    g = p.add_argument_group("--to recursive (Relaxed Recursive Transformers, sections 2.2-2.3)")
    g.add_argument("--loops", type=int, default=2, help="loops B over L/B shared layers; must divide the depth (default: 2)")
    g.add_argument("--init", default="stepwise", help=f"shared-layer init: {', '.join(LOOP_INITS)} (default: stepwise)")
    g.add_argument("--strategy", default="cycle", help=f"layer tying: {', '.join(TYING_STRATEGIES)} (default: cycle)")
    g.add_argument("--relax", choices=["none", "lora", "prefix"], default=None,
                   help="relaxation: per-loop LoRA (--lora-rank) or per-position prefix (--prefix-len); "
                   "default: lora when --lora-rank is given, else none")
    g.add_argument("--lora-rank", type=int, default=0, help="LoRA rank r per shared linear and loop (default: 0, none)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha; scaling alpha/r (default: r, scaling 1)")
    g.add_argument("--lora-init", default="svd",
                   help=f"LoRA init: {', '.join(LORA_INITS)} (default: svd, equation 4; svd_effective also absorbs "
                   "differing tied norm gains at full rank)")
    g.add_argument("--seed", type=int, default=0, help="seed of random and zero inits (default: 0)")


def _convert_recursive(args: argparse.Namespace) -> int:
    from blockloop.convert import vanilla_to_recursive
    from blockloop.train import checkpoint as ckpt
    from blockloop.train.run import load_trained

    relax = args.relax or ("lora" if args.lora_rank else "none")
    prefix_len = args.prefix_len or 0
    if relax == "lora" and args.lora_rank < 1:
        raise BlockloopError("--relax lora needs --lora-rank R (R >= 1)")
    if relax == "prefix" and prefix_len < 1:
        raise BlockloopError("--relax prefix needs --prefix-len N (N >= 1)")
    if relax != "lora" and args.lora_rank:
        raise BlockloopError(f"--lora-rank is for --relax lora, not --relax {relax}")
    if relax != "prefix" and prefix_len:
        raise BlockloopError(f"--prefix-len is for --relax prefix, not --relax {relax}")
    out = Path(args.out)
    if (out / "model.safetensors").exists():
        raise BlockloopError(f"{out} already holds a model; choose another --out")
    source = load_trained(args.checkpoint)
    model = vanilla_to_recursive(
        source.model, loops=args.loops, init=args.init, tying=args.strategy, lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha, lora_init=args.lora_init, prefix_len=prefix_len, seed=args.seed,
    )
    out.mkdir(parents=True, exist_ok=True)
    ckpt.save_model_files(out, model, model.config)
    source.tokenizer.save(out)
    run = source.state.get("run", {})
    ckpt.write_json_atomic(out / "train_state.json", {"step": 0, "run": run, "converted_from": str(source.directory)})
    print(
        f"wrote {model.config.name} ({model.num_parameters() / 1e6:.2f}M parameters vs {source.model.num_parameters() / 1e6:.2f}M; "
        f"{model.config.summary()}, {args.init} init) to {out}; uptrain with: blockloop train --init-from {out} --out RUN"
    )
    return 0


def _convert_to_hf(args: argparse.Namespace) -> int:
    from blockloop.convert.hf_checkpoint import export_checkpoint
    from blockloop.train.run import load_trained

    source = load_trained(args.checkpoint)
    out = export_checkpoint(source.model, source.tokenizer, Path(args.out))
    print(f"wrote a Hugging Face model to {out}; load it with transformers.AutoModelForCausalLM.from_pretrained")
    return 0


def _add_recursive_train_flags(p: argparse.ArgumentParser) -> None:
    from blockloop.config import EXIT_LOSSES

    g = p.add_argument_group("recursive models: distillation and early exit (section 3.7, appendices L, M)")
    g.add_argument("--distill-from", metavar="RUN",
                   help="add forward-KL distillation from this frozen teacher (e.g. the model a recursive one was "
                   "converted from); the teacher is never saved with the student")
    g.add_argument("--distill-weight", type=float, default=1.0, help="weight of the KL term (default: 1.0)")
    g.add_argument("--early-exit", choices=EXIT_LOSSES,
                   help="train every loop's exit: weighted (alpha_i = i / sum i) or aggressive (intermediate loops "
                   "x --exit-coefficient, final x 1); recursive models only")
    g.add_argument("--exit-coefficient", type=float, help="aggressive strategy: intermediate-loop weight (default: 0.1)")
    g.add_argument("--exit-kd-weight", type=float,
                   help="add KD from the detached final loop to each intermediate loop, with this weight (default: 0)")


def _apply_early_exit(run: PreparedRun, args: argparse.Namespace) -> None:
    """Set the early-exit loss fields of a recursive model's config (also on a model loaded with --init-from)."""
    changes = {
        field: getattr(args, flag) for field, flag in
        (("exit_loss", "early_exit"), ("exit_coefficient", "exit_coefficient"), ("exit_kd_weight", "exit_kd_weight"))
        if getattr(args, flag, None) is not None
    }
    if not changes:
        return
    if run.model_config.family != "recursive":
        raise BlockloopError(f"--early-exit and --exit-* train recursive models, not {run.model_config.family} models")
    run.model_config = run.model.config = run.model_config.replace(**changes)


def _eval_per_loop(model: nn.Module, seqs: PackedSequences, args: argparse.Namespace, device: str, data: str) -> int:
    from blockloop.train.exit_eval import evaluate_loops

    metrics = evaluate_loops(model, seqs, batch_size=args.batch_size, max_batches=args.max_batches, device=device)
    if args.json:
        print(json.dumps({"data": data, "split": args.split, **metrics}))
        return 0
    rows = [("loop", "loss", "perplexity", "accuracy", "agreement with final", "oracle exit share")]
    rows += [(str(r["loop"]), f"{r['loss']:.4f}", f"{r['perplexity']:.3f}", f"{r['accuracy']:.4f}",
              f"{r['agreement']:.4f}", f"{r['oracle_exit_share']:.4f}") for r in metrics["loops"]]
    print(f"{data} {args.split}, static exit after each loop ({metrics['tokens']} tokens):")
    _print_table(rows)
    print(f"oracle exit: {metrics['mean_exit_loop']:.3f} loops per token on average of {len(metrics['loops'])}")
    return 0


# ---------------------------------------------------------------------- tasks
def _add_tasks(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tasks",
        help="list or write the synthetic state-tracking tasks (algorithm-3, algorithm-5, random-walk)",
        description="Seeded train/valid/test splits of labelled-position tasks, written as memory-mappable arrays.",
    )
    verbs = p.add_subparsers(dest="tasks_command", required=True, metavar="VERB")
    verbs.add_parser("list", help="the task names, default sizes and descriptions").set_defaults(handler=cmd_tasks_list)
    m = verbs.add_parser("make", help="generate a task and write its splits to --out")
    m.add_argument("name", help="task name (see `blockloop tasks list`)")
    m.add_argument("--out", required=True, help="directory to create (must not exist, or be empty)")
    m.add_argument("--seed", type=int, default=0, help="seed of the three splits (default: 0)")
    m.add_argument("--sizes", help="TRAIN,VALID,TEST counts of programs or sequences (default: the task's own)")
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
    m.set_defaults(handler=cmd_tasks_make)


def cmd_tasks_list(args: argparse.Namespace) -> int:
    from blockloop.data.tasks import TASKS

    rows = [("task", "vocab", "default sizes", "description")]
    rows += [
        (t.name, str(t.vocab.vocab_size), "/".join(map(str, t.default_sizes)), t.description) for t in TASKS.values()
    ]
    _print_table(rows)
    return 0


def cmd_tasks_make(args: argparse.Namespace) -> int:
    from blockloop.data.tasks import get_task, load_task, write_task

    get_task(args.name)  # an unknown name fails before the sizes are looked at
    sizes = None
    if args.sizes is not None:
        try:
            sizes = [int(part) for part in args.sizes.split(",")]
        except ValueError:
            raise BlockloopError(f"--sizes expects three counts TRAIN,VALID,TEST, got {args.sizes!r}") from None
    out = write_task(args.name, Path(args.out), seed=args.seed, sizes=sizes, show_progress=not args.no_progress)
    meta = load_task(out).meta
    counts = ", ".join(f"{split} {meta['sizes'][split]} ({meta['tokens'][split]} tokens)" for split in meta["sizes"])
    print(f"wrote {args.name} (seed {args.seed}) to {out}: {counts}")
# ---------------------------------------------------------------------- flops
def _add_flops(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "flops",
        help="training FLOPs and KV-cache memory of a preset: the paper's formulas, its config, torch's FLOP counter",
        description="Architecture-aware training FLOPs (double-decoder paper, appendix A.2) and generation KV-cache "
        "bytes (appendix A.1) for a preset, with the decoder-only model of the same width and depth for comparison.",
    )
    p.add_argument("--preset", required=True, help="model preset (see `blockloop presets`)")
    p.add_argument("--seq-len", type=int, help="training window / prompt length T (default: the preset's context)")
    p.add_argument("--out-len", type=int, default=256, help="generated tokens T_out for the KV cache (default: 256)")
    p.add_argument("--bytes", type=int, default=2, help="bytes per cached value (default: 2, bf16)")
    p.add_argument("--measure", action="store_true", help="also count one forward with torch's FlopCounterMode")
    p.set_defaults(handler=cmd_flops)


def cmd_flops(args: argparse.Namespace) -> int:
    import torch

    from blockloop.data.collate import collate_for, step_generator
    from blockloop.models import build_model
    from blockloop.presets import from_name
    from blockloop.train import flops

    config = from_name(args.preset)
    T = args.seq_len or config.context_length
    if not 2 <= T <= config.context_length:
        raise BlockloopError(f"--seq-len must be in 2..{config.context_length} (the model context), got {T}")
    if args.out_len < 1 or args.bytes < 1:
        raise BlockloopError("--out-len and --bytes must be at least 1")
    if config.family == "block":
        return _block_flops(config, T, args)
    if config.family in ("staircase", "ladder"):
        return _recurrent_flops(config, T, args)
    if config.family == "recursive":  # weights are shared, compute and KV cache are not: count the looped depth
        print(f"{args.preset}: {config.summary()}; FLOPs and KV cache are those of its {config.depth}-layer looped depth")
        config = config.stack(config.depth)
    baseline = config.stack(config.n_layer)
    rows = [("model", "paper formula FLOPs/token", "config FLOPs/token", "measured FLOPs/token", f"KV cache T={T}+{args.out_len}")]
    for label, c in ((f"{config.family} ({args.preset})", config), ("decoder-only, same width/depth", baseline)):
        t_in, t_out = flops.encoder_decoder_lengths(c, T) if c.family == "encoder_decoder" else (T, None)
        paper = flops.paper_training_flops(c.family, t_in, c.d_model, c.n_layer, t_out) / T
        exact = flops.training_flops_per_token(c, T)
        measured = "-"
        if args.measure:
            with torch.device("meta"):
                model = build_model(c)
            batch = collate_for(model)(torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, dtype=torch.long), step_generator(0, 0))
            batch.pop("targets")
            measured = f"{3 * flops.measured_forward_flops(model, {k: v.to('meta') for k, v in batch.items()}) / T:.4g}"
        kv = flops.kv_cache_bytes(c, T, args.out_len, args.bytes)
        rows.append((label, f"{paper:.4g}", f"{exact:.4g}", measured, f"{kv / 2**20:.2f} MiB"))
        if c is config and c.family == "decoder":
            break
    _print_table(rows)
    print("paper formula: appendix A.2 (MHA, 4d MLP, no LM head, 2/3-1/3 split); config: this preset's exact shapes "
          "incl. LM head; measured: 3 x one forward under torch FlopCounterMode (the double decoder's dense dual "
          "attention counts two attentions where the paper's efficient implementation counts one).")
    return 0


def _block_flops(config: "BlockTransformerConfig", T: int, args: argparse.Namespace) -> int:  # noqa: F821
    """A Block Transformer has no appendix-A formula: its own count, measured FLOPs, and its allocated caches."""
    import torch

    from blockloop.models import build_model
    from blockloop.train import flops

    if T % config.block_len:
        raise BlockloopError(f"--seq-len {T} is not a multiple of the block length {config.block_len}")
    with torch.device("meta"):
        model = build_model(config.replace(context_length=-(-(T + args.out_len) // config.block_len) * config.block_len))
        caches = model.generation_caches(1, T, args.out_len)
    kv = sum(layer.k.numel() + layer.v.numel() for cache in caches for layer in cache.layers) * args.bytes
    measured = "-"
    if args.measure:
        idx = torch.zeros(1, T, dtype=torch.long, device="meta")
        measured = f"{3 * flops.measured_forward_flops(model, {'idx': idx}) / T:.4g}"
    rows = [("model", "config FLOPs/token", "measured FLOPs/token", f"KV cache T={T}+{args.out_len}"),
            (f"block ({args.preset})", f"{flops.block_flops_per_token(config, T):.4g}", measured, f"{kv / 2**20:.2f} MiB")]
    _print_table(rows)
    print("config: steady-state training FLOPs per token (block decoder once per block, token decoder n_lead + L_B - 1 "
          "positions per block); measured: 3 x one forward under torch FlopCounterMode (the first block of a window "
          "is not decoded); KV cache: the block decoder's cache plus one block of token-decoder cache.")
    return 0


def _recurrent_flops(config: "DecoderConfig", T: int, args: argparse.Namespace) -> int:  # noqa: F821
    """The staircase family has no appendix-A formula: the core counted once per pass, measured FLOPs, and
    the generation state the engine allocates per slot, beside the core run once as a plain decoder."""
    import torch

    from blockloop.models import build_model
    from blockloop.serve.runners import runner_for
    from blockloop.train import flops

    with torch.device("meta"):
        model = build_model(config)
        if config.family == "staircase":  # bounded by S and the cache, whatever the stream length
            runner = runner_for(model)
            runner.allocate(1, T + args.out_len)
            caches = runner.state.passes
        else:
            caches = model.generation_caches(1, T, args.out_len)
    state = sum(layer.k.numel() + layer.v.numel() for cache in caches for layer in cache.layers) * args.bytes
    measured = "-"
    if args.measure:
        idx = torch.zeros(1, T, dtype=torch.long, device="meta")
        measured = f"{3 * flops.measured_forward_flops(model, {'idx': idx}) / T:.4g}"
    core = config.stack(config.n_layer)
    rows = [("model", "config FLOPs/token", "measured FLOPs/token", f"generation KV state T={T}+{args.out_len}"),
            (f"{config.family} ({args.preset})", f"{flops.training_flops_per_token(config, T):.4g}", measured,
             f"{state / 2**20:.2f} MiB"),
            ("core as a plain decoder (one pass)", f"{flops.training_flops_per_token(core, T):.4g}", "-",
             f"{flops.kv_cache_bytes(core, T, args.out_len, args.bytes) / 2**20:.2f} MiB")]
    _print_table(rows)
    print("config: steady-state training FLOPs per token (the core once per pass, full windows, cache/memory "
          "projections); measured: 3 x one forward from an empty stream under torch FlopCounterMode; state: the "
          "static caches generation allocates per slot (a staircase's is bounded by S and the cache).")
    return 0


# -------------------------------------------------------------- presets, info
def cmd_presets(args: argparse.Namespace) -> int:
    import torch

    from blockloop.models import build_model
    from blockloop.presets import PRESETS, from_name

    rows = [("preset", "family", "shape", "non-emb params", "total params", "description")]
    for name, preset in PRESETS.items():
        c = from_name(name)
        with torch.device("meta"):  # counts without allocating the weights
            model = build_model(c)
        rows.append(
            (name, c.family, c.summary(), _human(model.num_parameters(non_embedding=True)),
             _human(model.num_parameters()), preset.description)
        )
    _print_table(rows)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    import blockloop

    if args.checkpoint is None:
        print(f"blockloop {blockloop.__version__}, python {platform.python_version()}, torch {torch.__version__}")
        print(f"cuda available: {torch.cuda.is_available()}" + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else ""))
        print(f"cache: {os.environ.get('BLOCKLOOP_CACHE', str(Path.home() / '.cache' / 'blockloop'))}")
        return 0
    from blockloop.train.run import load_trained

    trained = load_trained(args.checkpoint)
    m = trained.model
    print(f"checkpoint: {trained.directory}")
    print(f"model: {trained.config.family} {trained.config.name}, {m.num_parameters() / 1e6:.3f}M parameters "
          f"({m.num_parameters(non_embedding=True) / 1e6:.3f}M non-embedding)")
    print(f"tokenizer: {trained.tokenizer.name} (vocab {trained.tokenizer.vocab_size})")
    if trained.state:
        print(f"trained: step {trained.state['step']} on {trained.state['run'].get('data')}")
    print("config: " + json.dumps(trained.config.to_dict()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from blockloop.demo import run_demo

    run_demo(Path(args.out), steps=args.steps, device=_device(args.device))
    return 0


# -------------------------------------------------------------------- helpers
def _parse_overrides(items: list[str]) -> dict[str, object]:
    """``FIELD=VALUE`` pairs; values are read as JSON (numbers, true/false, null) or else as strings."""
    overrides: dict[str, object] = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise BlockloopError(f"--set expects FIELD=VALUE, got {item!r}")
        try:
            overrides[field] = json.loads(value)
        except json.JSONDecodeError:
            overrides[field] = value
    return overrides


# ---------------------------------------------------------------------- bench
def _add_bench(sub: argparse._SubParsersAction) -> None:
    from blockloop.bench.cli import add_arguments

    p = sub.add_parser(
        "bench", help="benchmark inference: throughput protocol, request stream, Pareto plot",
        description="Time the serving engine with the Block Transformer paper's protocol (random prompts, no EOS, "
        "warm-up, repeated runs), or serve a stream of corpus prompts (--stream), or plot recorded runs (--plot).",
    )
    add_arguments(p)
    p.set_defaults(handler=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from blockloop.bench.cli import run

    return run(args, _device(args.device))


def _device(name: str) -> str:
    from blockloop.device import resolve_device

    return resolve_device(name)


def _human(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    raise SystemExit(main())
