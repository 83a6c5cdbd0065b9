"""``blockloop chat``: talk to a checkpoint in the terminal, answers streamed as they are generated."""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from blockloop.cli.common import (
    add_checkpoint,
    add_device,
    add_no_pack,
    add_sampling,
    check_sampling,
    positive_int,
    sampling_seed,
    terminal_safe,
    utf8_text,
)
from blockloop.cli.serve import add_chat_template, add_engine_arguments, load
from blockloop.errors import BlockloopError, utf8_problem
from blockloop.signals import Terminated

if TYPE_CHECKING:
    from blockloop.serve.http.chat import ChatSession

HELP = "chat with a checkpoint in the terminal"
DESCRIPTION = ("An interactive chat on the serving engine: answers stream as they are generated, the history is "
               "trimmed to the model context (--max-len for a Staircase or Transformer-XL, which stream past it), "
               "/reset starts over, /quit (or Ctrl-D) leaves, and Ctrl-C stops the current answer. Chats use "
               "--chat-template, else the checkpoint's chat template, else a plain User:/Assistant: one.")
COMMANDS_HELP = "/reset forgets the conversation, /quit leaves; Ctrl-C stops an answer"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint(p)
    p.add_argument("--system", type=utf8_text, help="a system message that starts every conversation")
    add_chat_template(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens per answer at most (default: 256)")
    add_sampling(p)
    p.add_argument("--seed", type=sampling_seed,
                   help="seed of the first answer; answer i uses seed + i, so a seeded conversation replays "
                   "(default: a new one each session, as a server request without a seed gets)")
    add_engine_arguments(p, slots=1)
    add_device(p)
    add_no_pack(p)


def run(args: argparse.Namespace) -> int:
    from blockloop.serve.http.chat import ChatSession, chat_template_for
    from blockloop.serve.http.worker import EngineWorker, serving_engine
    from blockloop.serve.requests import SamplingParams

    check_sampling(args)
    trained, options = load(args, n_slots=args.slots)
    worker = EngineWorker(serving_engine(trained.model, **options))
    template = chat_template_for(trained.tokenizer, trained.directory, args.chat_template)
    session = ChatSession(worker, trained.tokenizer, template, max_new_tokens=args.max_new_tokens, system=args.system,
                          sampling=SamplingParams(args.temperature, args.top_k, args.top_p,
                                                  seed=secrets.randbits(31) if args.seed is None else args.seed))
    if args.max_new_tokens > session.worker.engine.longest_request:
        print(f"warning: --max-new-tokens {args.max_new_tokens} is more than the {session.worker.engine.longest_request} "
              "tokens a request may take here; each answer ends where its context is full", file=sys.stderr)
    write = (lambda text: sys.stdout.write(terminal_safe(text))) if sys.stdout.isatty() else sys.stdout.write
    worker.start()
    try:
        converse(session, input, write, interactive=sys.stdin.isatty())
    except Terminated:
        write("\n")  # the stop's line starts on a line of its own, not after the answer or prompt so far
        raise
    finally:
        worker.close()
    return 0


def converse(session: ChatSession, read: Callable[[str], str], write: Callable[[str], object], *, interactive: bool = True) -> None:
    """The chat loop: ``read(prompt)`` gives the user's lines (EOFError ends), ``write`` shows the answers."""
    if interactive:
        write(f"({COMMANDS_HELP})\n")
    while True:
        try:
            line = read("> " if interactive else "").strip()
        except EOFError:
            write("\n" if interactive else "")
            return
        except Terminated:
            raise
        except KeyboardInterrupt:  # at the prompt: a new line, not the end
            write(f"\n({COMMANDS_HELP})\n")
            continue
        if line in ("/quit", "/exit"):
            return
        if line == "/reset":
            session.reset()
            write("(conversation reset)\n")
            continue
        if not line:
            continue
        if line.startswith("/") and not any(c.isspace() for c in line):  # /help, /set-seed, /: not a message
            write(f"(no command {line}: {COMMANDS_HELP})\n")
            continue
        problem = utf8_problem(line)
        if problem is not None:
            write(f"(that line {problem}; type it again in UTF-8)\n")
            continue
        try:
            answer, reason = session.ask(line, lambda text: (write(text), sys.stdout.flush()))
        except BlockloopError as exc:  # this message cannot be answered; the next one may be
            if not session.worker.healthy:
                raise
            write(f"({exc})\n")
            continue
        write(" [stopped]\n" if reason == "interrupted" else "\n")
        if session.dropped:
            write(f"({session.dropped} earlier message{'s' * (session.dropped > 1)} left out of the conversation "
                  f"to fit {session.limit()})\n")
