"""``blockloop convert``: a trained model into another family (for uptraining) or a Hugging Face folder, and
Hugging Face models in. The targets and their options come from :data:`blockloop.convert.targets.TARGETS`."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from blockloop.cli.common import (
    add_no_progress,
    nonempty,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    refuse_flags,
)
from blockloop.errors import BlockloopError

HELP = ("turn a trained model into another family for uptraining (then `train --init-from`); import or export "
        "Hugging Face models")
DESCRIPTION = ("Initialise a structured model from a trained vanilla one and write it as a checkpoint; continue with "
               "`blockloop train --init-from OUT`. --from-hf imports a Hugging Face causal LM (Llama, Mistral, Qwen2, "
               "Gemma, Gemma-3, GPT-NeoX, GPT-2) as a checkpoint; --to hf exports a vanilla checkpoint to a Hugging Face folder.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from blockloop.convert.targets import TARGETS

    p.add_argument("--to", choices=list(TARGETS),
                   help="target: " + "; ".join(f"{name}, {t.title}" for name, t in TARGETS.items()))
    p.add_argument("--checkpoint", type=nonempty, help="run directory or checkpoint of a trained vanilla model (with --to)")
    p.add_argument(
        "--from-hf", metavar="PATH",
        help="import a Hugging Face model folder (config.json + safetensors, or a GGUF with --gguf-file), or "
        "'smollm2' to fetch and import the built-in SmolLM2-135M-Instruct",
    )
    p.add_argument("--gguf-file", metavar="NAME", help="--from-hf: the .gguf file inside PATH to read")
    p.add_argument("--tokenizer", help="--from-hf: tokenizer to save with the model (default: the source's own tokenizer)")
    p.add_argument("--out", required=True, type=nonempty, help="directory to write the converted checkpoint to")
    add_no_progress(p)
    # An option several targets take is one flag; its help says what it means to each.
    helps: dict[str, dict[str, str]] = {}
    for name, target in TARGETS.items():
        for option in target.options:
            helps.setdefault(option.name, {})[name] = option.help
    added: set[str] = set()
    for name, target in TARGETS.items():
        if not target.options:
            continue
        g = p.add_argument_group(f"--to {name}: {target.title}")
        for option in target.options:
            if option.name in added:
                continue
            added.add(option.name)
            # default None: a flag given to a target that ignores it is told apart from one left alone (run)
            kind = positive_float if option.positive else CHECKED.get(option.type, option.type)
            g.add_argument(f"--{option.name.replace('_', '-')}", type=kind,
                           choices=option.choices, help=_merged_help(helps[option.name]))


# Every numeric option of a target counts or scales something: none is negative, NaN or infinite (nor 0 where
# the option says it is positive).
CHECKED = {int: nonnegative_int, float: nonnegative_float}


def _merged_help(helps: dict[str, str]) -> str:
    """One target's help (or one help that means the same to each) as it is; else ``TARGET: help; TARGET: help``."""
    return next(iter(helps.values())) if len(set(helps.values())) == 1 else "; ".join(f"{t}: {h}" for t, h in helps.items())


def run(args: argparse.Namespace) -> int:
    from blockloop.convert.checkpoints import convert_checkpoint
    from blockloop.convert.targets import TARGETS

    if (args.from_hf is None) == (args.to is None):
        raise BlockloopError(
            f"give either --from-hf PATH (import) or --to {'|'.join(TARGETS)} --checkpoint RUN (convert/export)"
        )
    # A flag the chosen mode would ignore is refused (--loops on an import or on --to block, ...).
    imports = {"gguf_file", "tokenizer", "save_dtype"}
    takes = {"checkpoint", *(o.name for o in TARGETS[args.to].options)} if args.to else imports
    flags = {"checkpoint", *imports} | {o.name for t in TARGETS.values() for o in t.options}
    ignored = sorted(name for name in flags - takes if getattr(args, name) is not None)
    if ignored:
        refuse_flags(ignored, f"--to {args.to}" if args.to else "--from-hf")
    if args.to and TARGETS[args.to].unread:  # and a flag the target's other flags make meaningless
        given = {o.name: getattr(args, o.name) for o in TARGETS[args.to].options if getattr(args, o.name) is not None}
        unread, mode, or_else = TARGETS[args.to].unread(given)
        if unread:
            refuse_flags(unread, mode, or_else=or_else)
    if args.from_hf is not None:
        from blockloop.convert.hf_checkpoint import import_checkpoint

        save_dtype = args.save_dtype or "float32"
        model, tokenizer = import_checkpoint(args.from_hf, Path(args.out), gguf_file=args.gguf_file,
                                             tokenizer=args.tokenizer, save_dtype=save_dtype)
        print(
            f"wrote {model.config.name} ({model.num_parameters() / 1e6:.2f}M parameters in {save_dtype}, "
            f"{model.config.summary()}, tokenizer {tokenizer.name}) to {args.out}; try: blockloop generate --checkpoint {shlex.quote(args.out)} --prompt TEXT"
        )
        return 0
    if args.checkpoint is None:
        raise BlockloopError(f"--to {args.to} needs --checkpoint RUN, the trained model to convert")
    options = {o.name: o.default if getattr(args, o.name) is None else getattr(args, o.name) for o in TARGETS[args.to].options}
    done = convert_checkpoint(args.to, args.checkpoint, Path(args.out), **options)
    print(f"wrote {done.what} to {done.out}; {done.hint}")
    return 0
