"""``blockloop generate``: continue a prompt from a checkpoint, streaming one sample or printing several."""

from __future__ import annotations

import argparse
import sys

from blockloop.cli.common import (
    MEMORY_FIXES,
    add_checkpoint,
    add_device,
    add_looped_decoding,
    add_no_pack,
    add_sampling,
    add_threads,
    check_sampling,
    looped_decoding,
    positive_int,
    sampling_seed,
    set_threads,
    terminal_safe,
    utf8_text,
)
from blockloop.errors import BlockloopError

HELP = "stream a continuation of --prompt from a checkpoint, token by token"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint(p)
    p.add_argument("--prompt", required=True, type=utf8_text, help="text to continue")
    p.add_argument(
        "--max-new-tokens", type=positive_int, help="tokens to generate at most (default: 200, or what fits in the model "
        "context; the staircase family and models with a memory_len, Transformer-XL, stream past it)"
    )
    add_sampling(p)
    p.add_argument("--num-samples", type=positive_int, default=1, help="independent continuations, generated as one batch")
    p.add_argument("--seed", type=sampling_seed,
                   help="seed for sampling (same seed, same text; sample i uses seed + i, as a server request does)")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    add_looped_decoding(p)
    add_device(p)
    add_threads(p)
    add_no_pack(p)


def run(args: argparse.Namespace) -> int:
    from blockloop.data.tasks.tokenizer import answer_length
    from blockloop.device import OutOfMemory, resolve_device
    from blockloop.serve.batching import padded_prompt_length, prompt_size
    from blockloop.serve.generate import generate
    from blockloop.serve.http.text import TextStream, continuation
    from blockloop.serve.runners import runner_for
    from blockloop.train.run import load_trained

    decoding = looped_decoding(args)
    check_sampling(args)
    set_threads(args.threads)
    trained = load_trained(args.checkpoint, resolve_device(args.device))
    tok = trained.tokenizer
    prompt = tok.encode_prompt(args.prompt)
    max_new = answer_length(tok, args.max_new_tokens, "--max-new-tokens")
    if max_new is None:  # what the context leaves after the prompt as the model reads it (a block model pads it)
        padded = padded_prompt_length(trained.model, [prompt])
        streams = runner_for(trained.model).streams  # a staircase or Transformer-XL reads on past its context
        max_new = 200 if streams else min(200, trained.config.context_length - padded)
        if max_new < 1:
            raise BlockloopError(
                f"{prompt_size(len(prompt), padded)} fills the model context of {trained.config.context_length}; shorten it"
            )
    kwargs = dict(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        eos_id=None if args.no_stop else tok.eos_id, seed=args.seed,
        **decoding,
    )
    safe = terminal_safe if sys.stdout.isatty() else str  # a model's control characters cannot rewrite a terminal
    try:
        if args.num_samples == 1:
            # Stream each token's text as soon as it decodes to whole characters; the prompt goes out with the
            # first token, so a request the engine refuses writes nothing.
            stream = TextStream(tok, prompt=prompt)
            pending = [args.prompt]

            def on_token(row: int, token: int) -> None:
                pending.append(stream.push(token))
                sys.stdout.write(safe("".join(pending)))
                sys.stdout.flush()
                pending.clear()

            try:
                generate(trained.model, [prompt], max_new, on_token=on_token, **kwargs)
            except KeyboardInterrupt:
                if not pending:  # text went out: the stop's line starts on a line of its own, not after the text
                    sys.stdout.write("\n")
                raise
            sys.stdout.write(safe("".join(pending) + stream.flush()) + "\n")
        else:
            outs = generate(trained.model, [prompt] * args.num_samples, max_new, **kwargs)
            for i, out in enumerate(outs):
                print(f"--- sample {i + 1}\n{safe(args.prompt + continuation(tok, prompt, out))}")
    except OutOfMemory as exc:  # the engine's cache: what to ask less of is this verb's flags, not a server's
        raise BlockloopError(f"{exc.what}; {MEMORY_FIXES['generate']}") from None
    return 0
