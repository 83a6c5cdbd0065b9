"""``blockloop <verb>``: train, eval, generate, convert, tasks, presets, flops, bench, info, demo, serve, chat.

:data:`COMMANDS` maps each verb to a small module that declares its arguments (``HELP``, ``DESCRIPTION``,
``add_arguments``), calls the library and prints (``run``); the decisions live in the library, where the
Python API gets the same answers. Only the named verb's arguments are built, from torch-free modules (their
choices and defaults come from ``choices.py``, ``train/config.py`` and ``convert/targets.py``; the library
is imported inside ``run``), so ``blockloop --help`` and every ``blockloop VERB --help`` start at once.
User mistakes surface as :class:`BlockloopError` and are printed as one
line on stderr with exit code 2, as are the environment's refusals: an OS error that names a path (a full disk,
a read-only folder, a file where a folder belongs: :data:`OS_ERRORS` has the fix for the common ones, and the path
is the fix for the rest); anything else is a bug and keeps its traceback. ``--debug``
(or ``BLOCKLOOP_DEBUG=1``) shows the traceback of every error.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
from collections.abc import Collection, Sequence
from types import ModuleType
from typing import NoReturn

from blockloop.cli import bench, chat, convert, demo, flops, generate, info, presets, serve, tasks, train
from blockloop.cli import eval as eval_
from blockloop.cli.common import MEMORY_FIXES, OTHER_MEMORY_FIX
from blockloop.errors import BlockloopError
from blockloop.signals import terminate_as_interrupt

EXIT_USER_ERROR = 2
# Optional packages and the extra that installs each: a verb that needs one says so in one line.
EXTRAS = {"transformers": "hf", "gguf": "hf", "matplotlib": "plot", "pyarrow": "eval", "lm_eval": "eval",
          "fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve", "httpx": "serve"}

# What the environment refuses, with the fix; the message names the path.
OS_ERRORS = {
    errno.ENOSPC: "free some space or write elsewhere", errno.EDQUOT: "free some space or write elsewhere",
    errno.EROFS: "write to a writable location", errno.EACCES: "check the permissions or write elsewhere",
    errno.EPERM: "check the permissions or write elsewhere", errno.ENOTDIR: "a file stands where a folder belongs",
    errno.EISDIR: "a folder stands where a file belongs", errno.EEXIST: "a file stands where a folder belongs",
    errno.ENAMETOOLONG: "use a shorter path", errno.ELOOP: "fix the symbolic links",
}
OTHER_OS_ERROR = "check the path or write elsewhere"  # any other refusal that names a path (/proc/x: ENOENT)

COMMANDS: dict[str, ModuleType] = {
    "train": train, "eval": eval_, "generate": generate, "convert": convert, "tasks": tasks, "presets": presets,
    "flops": flops, "bench": bench, "info": info, "demo": demo, "serve": serve, "chat": chat,
}


def _tolerate_narrow_encodings() -> None:
    """Where the standard streams are not UTF-8 (``PYTHONIOENCODING=ascii``, a latin-1 locale), text a model writes
    that the stream cannot encode is written as escapes (``\U0001f642``) instead of ending the command with a
    traceback, and input is read as UTF-8 (what blockloop's tokenizers take), undecodable bytes kept for the
    reader to name (:func:`~blockloop.errors.utf8_problem`)."""
    def narrow(stream: object) -> bool:
        encoding = (getattr(stream, "encoding", None) or "utf-8").lower().replace("-", "").replace("_", "")
        return hasattr(stream, "reconfigure") and encoding != "utf8"

    for stream in (sys.stdout, sys.stderr):
        if narrow(stream):
            stream.reconfigure(errors="backslashreplace")
    if narrow(sys.stdin):
        sys.stdin.reconfigure(encoding="utf-8", errors="surrogateescape")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The top-level parser has no options of its own besides --help: the first word is the verb.
    verb = next((word for word in argv if not word.startswith("-")), None)
    try:
        args, unknown = build_parser(verbs={verb} if verb else set()).parse_known_args(argv)
    except SystemExit as exc:  # an argument error (already printed) is an exit code; --help still exits
        if exc.code in (0, None):
            raise
        return int(exc.code)
    # what argparse's own errors begin with: the nested verb too (blockloop tasks make), so every error says the same
    prog = " ".join(filter(None, ("blockloop", args.command, getattr(args, f"{args.command}_command", None))))
    if args.command != "train" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Every rank would do the whole job and print it again, or two servers would fight over one port.
        print(f"{prog}: error: only train runs across torchrun's processes; run "
              f"blockloop {args.command} as one process, without torchrun", file=sys.stderr)
        return EXIT_USER_ERROR
    if unknown:  # argparse would blame the top-level parser; the help that lists the flags is the verb's
        print(f"{prog}: error: unrecognized arguments: {' '.join(unknown)}; see {prog} --help", file=sys.stderr)
        return EXIT_USER_ERROR
    if getattr(args, "no_progress", False):
        from blockloop import progress

        progress.set_enabled(False)
    if getattr(args, "no_pack", False):
        from blockloop.nn.linear import set_packing

        set_packing(False)
    _tolerate_narrow_encodings()
    if args.debug or os.environ.get("BLOCKLOOP_DEBUG", "") not in ("", "0"):
        with terminate_as_interrupt():
            return args.handler(args) or 0  # every error keeps its traceback
    try:
        # A scheduler's stop (SIGTERM) ends every verb as Ctrl-C does: a line saying so (and, for training, which
        # checkpoint is kept) and exit 130, not a silent death.
        with terminate_as_interrupt():
            code = args.handler(args) or 0
        sys.stdout.flush()  # inside the try: a reader that left early is noticed here, not at interpreter exit
        return code
    except BlockloopError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        if package not in EXTRAS:
            raise
        print(f"{prog}: error: this needs the optional package {package}; "
              f"install it with pip install 'blockloop[{EXTRAS[package]}]'", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:
        # The reader went away (`blockloop presets | head`): stop quietly, and keep Python's exit-time flush of
        # stdout from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (MemoryError, RuntimeError, OSError) as exc:  # after BrokenPipeError, an OSError too
        from blockloop.device import ran_out_of_memory

        if not ran_out_of_memory(exc):
            if isinstance(exc, OSError):
                return _os_error(prog, exc)
            raise
        print(f"{prog}: error: out of memory ({_allocation(exc)}); {MEMORY_FIXES.get(args.command, OTHER_MEMORY_FIX)}",
              file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt as stop:
        # A verb that kept part of its work says where, in the stop it raises again (eval's finished tasks).
        kept = f"; {stop.args[0]}" if stop.args else _checkpoints_kept(args)
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank is stopped: one says so
            print(f"{prog}: interrupted{kept}", file=sys.stderr)
        return 130


def _allocation(exc: BaseException) -> str:
    """What an allocator refused, in a few words: the size asked for where its message says (the CPU allocator's
    bytes, CUDA's GiB), else its first line."""
    text = str(exc)
    asked = re.search(r"tried to allocate (\d+) bytes", text)
    if asked:
        return f"{int(asked[1]) / 2**30:.2f} GiB could not be allocated"
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]iB)", text)
    if asked:
        return f"{asked[1]} could not be allocated on the GPU"
    first = " ".join(text.split("\n")[0].split())[:200]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _os_error(prog: str, exc: OSError) -> int:
    """An OS refusal that names a path (or has a known fix): one line, the path and the fix; any other is a bug."""
    if exc.errno not in OS_ERRORS and exc.filename is None:
        raise exc
    path = "a file" if exc.filename is None else exc.filename
    if exc.filename2 is not None:  # a rename or link: both ends
        path = f"{path} -> {exc.filename2}"
    print(f"{prog}: error: {exc.strerror}: {path}; {OS_ERRORS.get(exc.errno, OTHER_OS_ERROR)}"
          f"{_cache_hint(exc.filename)} (BLOCKLOOP_DEBUG=1 shows the traceback)", file=sys.stderr)
    return EXIT_USER_ERROR


def _checkpoints_kept(args: argparse.Namespace) -> str:
    """What an interrupted train or demo leaves to go on from: its last checkpoint, or none yet."""
    if args.command not in ("train", "demo") or not getattr(args, "out", None):
        return ""
    from pathlib import Path

    from blockloop.train.checkpoint import has_checkpoint

    out = Path(args.out)
    if args.command == "train":
        return (f"; the last checkpoint in {out} is kept: --resume goes on from it" if has_checkpoint(out)
                else "; no checkpoint was written yet")
    runs = [run for run in (out.iterdir() if out.is_dir() else []) if has_checkpoint(run)]
    return f"; the checkpoints written under {out} are kept" if runs else "; no checkpoint was written yet"


def _cache_hint(filename: object) -> str:
    """Where a refused path is blockloop's cache folder, in it, or above it (an unwritable or missing $HOME), the
    user never typed it: say what it is and how to move it."""
    if not isinstance(filename, (str, os.PathLike)):
        return ""
    from pathlib import Path

    from blockloop.data.packages import cache_dir

    cache, path = Path(os.path.abspath(cache_dir())), Path(os.path.abspath(filename))
    if path == cache or path in cache.parents or cache in path.parents:
        return f": it is blockloop's cache ({cache}); set BLOCKLOOP_CACHE to a writable folder"
    return ""


class Parser(argparse.ArgumentParser):
    """Argument errors in one line (a verb's usage runs to a screenful): what is wrong, and where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser(verbs: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line, with the arguments of ``verbs`` only (None: of every verb)."""
    parser = Parser(
        prog="blockloop",
        description="Train, evaluate and sample language models that reuse computation across depth and time.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for verb, module in COMMANDS.items():
        p = sub.add_parser(verb, help=module.HELP, description=getattr(module, "DESCRIPTION", None))
        if verbs is None or verb in verbs:
            module.add_arguments(p)
        p.add_argument("--debug", action="store_true", help="show the full traceback of any error (or BLOCKLOOP_DEBUG=1)")
        p.set_defaults(handler=module.run)
    return parser
