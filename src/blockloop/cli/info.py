"""``blockloop info``: the environment, or a checkpoint's model, tokenizer, training state and config."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from blockloop.cli.common import nonempty
from blockloop.errors import BlockloopError

HELP = "show the environment, or a checkpoint's config and training state"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", type=nonempty, help="run directory or checkpoint directory (omit for the environment)")
    p.add_argument("--checkpoint", dest="checkpoint_flag", metavar="CHECKPOINT", type=nonempty,
                   help="the same, as the other verbs take it")


def run(args: argparse.Namespace) -> int:
    import torch

    import blockloop
    from blockloop.data.packages import cache_dir

    if args.checkpoint is not None and args.checkpoint_flag is not None:
        raise BlockloopError("give the checkpoint once: as blockloop info RUN or blockloop info --checkpoint RUN")
    checkpoint = args.checkpoint or args.checkpoint_flag
    if checkpoint is None:
        print(f"blockloop {blockloop.__version__}, python {platform.python_version()}, torch {torch.__version__}")
        cuda = torch.cuda.is_available()
        print(f"cuda available: {cuda}" + (f" ({torch.cuda.get_device_name()})" if cuda else ""))
        print(f"cache: {cache_dir()}")
        return 0
    from blockloop.train import checkpoint as ckpt
    from blockloop.train.run import holds_model_alone, load_model_files, load_trained

    directory = ckpt.resolve_checkpoint(Path(checkpoint))
    if holds_model_alone(directory):  # what it is still shows, beside what it lacks
        (config, model), state, tokenizer = load_model_files(directory), {}, None
    else:
        trained = load_trained(directory)
        config, state, tokenizer, model = trained.config, trained.state, trained.tokenizer, trained.model
    print(f"checkpoint: {directory}")
    print(f"model: {config.family} {config.name}, {model.num_parameters() / 1e6:.3f}M parameters "
          f"({model.num_parameters(non_embedding=True) / 1e6:.3f}M non-embedding)")
    print(f"tokenizer: {tokenizer.name} (vocab {tokenizer.vocab_size})" if tokenizer else
          "tokenizer: none saved (the model alone; generate and eval need one: tokenizer.save(folder))")
    if state:
        print(training_line(state))
    print("config: " + json.dumps(config.to_dict()))
    return 0


def training_line(state: dict) -> str:
    """What the checkpoint's train_state says about how its weights came to be. A conversion or an import
    (``converted_from``) at step 0 was not trained: its ``run.data`` is only what ``eval`` scores by default."""
    run = state.get("run", {})
    step, data, origin = state.get("step", "?"), run.get("data"), state.get("converted_from")
    if origin is not None and step == 0:
        return f"origin: converted from {origin}, not trained since (recorded data, eval's default: {data})"
    tokens = state.get("tokens")
    objective = state.get("train_config", {}).get("objective", "lm")
    line = f"trained: step {step}{f' ({tokens:,} tokens)' if isinstance(tokens, int) else ''} on {data}"
    line += f" with the {objective} objective" if objective != "lm" else ""
    if origin is not None:  # --to weights keeps the source's step
        line += f" (weights copied from {origin}; no optimizer state)"
    if run.get("init_from"):
        line += f", initialised from {run['init_from']}"
    processes = state.get("world_size", 1)  # --resume needs as many: each rank's random state is its own
    if origin is None and isinstance(processes, int) and processes > 1:
        line += f", by {processes} processes (torchrun --nproc-per-node {processes} to resume)"
    return line
