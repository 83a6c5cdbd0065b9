"""``blockloop eval``: a checkpoint's loss, perplexity and bits per byte on a corpus split, its error on a task,
or a looped model's static exit after every loop (:mod:`blockloop.train.eval_checkpoint`)."""

from __future__ import annotations

import argparse
import json

from blockloop.cli.common import add_device, add_no_progress, print_table

HELP = "loss, perplexity and bits per byte of a checkpoint on a dataset split"


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    add_device(p)
    add_no_progress(p)
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.add_argument(
        "--per-loop", action="store_true",
        help="looped models: static early exit after every loop - loss, next-token accuracy, agreement with "
        "the final loop and the oracle-exit share per loop",
    )


def run(args: argparse.Namespace) -> int:
    from blockloop.train.eval_checkpoint import EvalRequest, evaluate_checkpoint

    request = EvalRequest(
        data=args.data, split=args.split, task=args.task, task_dir=args.task_dir, seq_len=args.seq_len,
        batch_size=args.batch_size, max_batches=args.max_batches, objective=args.objective, per_loop=args.per_loop,
    )
    result = evaluate_checkpoint(args.checkpoint, request, args.device)
    if args.json:
        print(json.dumps(result))
    elif "task" in result:
        print(f"{result['task']} {result['split']} ({int(result['tokens'])} labelled positions): "
              f"loss {result['loss']:.4f}, task error {result['error']:.2%}")
    elif "loops" in result:
        rows = [("loop", "loss", "perplexity", "accuracy", "agreement with final", "oracle exit share")]
        rows += [(str(r["loop"]), f"{r['loss']:.4f}", f"{r['perplexity']:.3f}", f"{r['accuracy']:.4f}",
                  f"{r['agreement']:.4f}", f"{r['oracle_exit_share']:.4f}") for r in result["loops"]]
        print(f"{result['data']} {result['split']}, static exit after each loop ({result['tokens']} tokens):")
        print_table(rows)
        print(f"oracle exit: {result['mean_exit_loop']:.3f} loops per token on average of {len(result['loops'])}")
    else:
        parts = [f"loss {result['loss']:.4f}", f"perplexity {result['perplexity']:.3f}"]
        if "bits_per_byte" in result:
            parts.append(f"bits/byte {result['bits_per_byte']:.4f}")
        print(f"{result['data']} {result['split']} {result['objective']} ({int(result['tokens'])} tokens): "
              + ", ".join(parts))
    return 0
