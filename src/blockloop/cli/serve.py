"""``blockloop serve``: an OpenAI-compatible HTTP server for a checkpoint (the ``serve`` extra)."""

from __future__ import annotations

import argparse
import errno
import os
import socket
from typing import TYPE_CHECKING, Any

from blockloop.cli.common import (
    add_checkpoint,
    add_device,
    add_key_buckets,
    add_looped_decoding,
    add_no_pack,
    add_threads,
    integer,
    looped_decoding,
    nonempty,
    nonnegative_int,
    positive_int,
    set_threads,
    text_file,
)
from blockloop.errors import BlockloopError

if TYPE_CHECKING:
    from blockloop.train.run import TrainedModel

HELP = "serve a checkpoint over an OpenAI-compatible HTTP API"
DESCRIPTION = ("Serve a checkpoint with continuous batching behind /v1/completions, /v1/chat/completions, /v1/models, "
               "/tokenize (as vLLM's), /health and /metrics (Prometheus), for the openai client, curl or "
               "`blockloop bench --url`.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--name", type=nonempty, help="the model name clients send (default: the training run's folder name)")
    add_chat_template(p)
    add_engine_arguments(p)
    p.add_argument("--max-waiting", type=nonnegative_int, default=256,
                   help="requests that may wait for a slot (beyond those free slots will take); past it the server answers "
                   "503 (default: 256)")
    p.add_argument("--shutdown-timeout", type=nonnegative_int, default=10, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long requests in flight may take to finish before they are cut off "
                   "(new connections are refused at once; a second Ctrl-C cuts them off now) (default: 10)")
    p.add_argument("--allowed-origin", type=origin, action="append", metavar="ORIGIN",
                   help="let web pages served from ORIGIN (scheme://host[:port], as a browser sends it, e.g. "
                   "http://localhost:3000) call the API from the browser (CORS); repeat for several, * for any page "
                   "(default: none: browsers keep pages from elsewhere from reading the answers)")
    p.add_argument("--api-key", type=nonempty, default=os.environ.get("BLOCKLOOP_API_KEY") or None,
                   help="answer /v1/... and /tokenize only for requests with Authorization: Bearer KEY, as vLLM's "
                   "--api-key (default: $BLOCKLOOP_API_KEY, which keeps the key out of the process list; none: open "
                   "to anyone who reaches the port)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: info, one line per request)")
    add_device(p)
    add_no_pack(p)


def add_engine_arguments(p: argparse.ArgumentParser, slots: int = 8) -> None:
    """The engine options ``serve`` and ``chat`` share."""
    p.add_argument("--slots", type=positive_int, default=slots, help=f"requests decoded together (default: {slots})")
    p.add_argument("--max-len", type=positive_int, help="tokens per slot, prompt and answer (default: the model context; "
                   "at most that, but for the staircase family and models with a memory_len (Transformer-XL), which "
                   "stream past it)")
    p.add_argument("--sync-every", type=positive_int,
                   help="decode steps between host syncs: tokens reach clients once per window (default: 1 on CPU, "
                   "where a sync costs nothing; 8 on a GPU). Rounded up to a whole block for a Block Transformer, "
                   "whose tokens so arrive a block at a time")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (CUDA graphs on CUDA), every graph before the first request")
    add_key_buckets(p)
    p.add_argument("--prefill-chunk", type=positive_int, default=512,
                   help="most prompt tokens a request caches per decode window, so long prompts do not stall the "
                   "running ones (default: 512)")
    p.add_argument("--kv-tokens", type=positive_int,
                   help="keep keys/values in a paged cache of this many tokens shared by the slots, each request "
                   "holding only its own length, rounded up to whole pages (vanilla, Ladder-family without a memory, "
                   "looped, block, double-decoder and encoder-decoder models; default: every slot holds --max-len)")
    p.add_argument("--page-size", type=positive_int,
                   help="cache entries per page of --kv-tokens (tokens; a Block Transformer's blocks) (default: 128)")
    add_threads(p)
    add_looped_decoding(p)


def add_chat_template(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", type=text_file, metavar="FILE",
                   help="a Jinja chat template file, in place of the checkpoint's (as vLLM's --chat-template)")


def run(args: argparse.Namespace) -> int:
    from blockloop.serve.http.app import app_for
    from blockloop.serve.http.server import serve
    from blockloop.train.checkpoint import run_folder

    sock = bind(args.host, args.port)  # before the model loads: a taken port or a wrong host fails at once, in one line
    try:
        trained, options = load(args, n_slots=args.slots)
        name = args.name or run_folder(args.checkpoint).name
        app = app_for(trained.model, trained.tokenizer, name=name, directory=trained.directory,
                      chat_template=args.chat_template, max_waiting=args.max_waiting,
                      allowed_origins=args.allowed_origin or (), api_key=args.api_key, **options)
        port = sock.getsockname()[1]  # --port 0: the one the system chose
        host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address in a URL
        depth = (f", depth-wise with exit {args.exit}" if args.exit else
                 f", speculating {args.speculate} tokens" if args.speculate else "")
        key = ", API key required" if args.api_key else ""
        print(f"serving {name} ({trained.config.family}, {args.slots} slots{depth}{key}) at http://{host}:{port}/v1")
        serve(app, sock, log_level=args.log_level, shutdown_timeout=args.shutdown_timeout)
    finally:
        sock.close()
    return 0


def origin(text: str) -> str:
    """An origin as browsers send it in their ``Origin`` header, which CORS compares as text: one written any other
    way (no scheme, a path, a trailing slash, a default port) would match no page, and every page would be refused."""
    from urllib.parse import urlsplit

    if text == "*":
        return text
    parts = urlsplit(text.lower())
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port, parts = None, parts._replace(netloc="")
    if (parts.scheme not in ("http", "https") or not parts.hostname or parts.username is not None or parts.path
            or parts.query or parts.fragment):
        raise argparse.ArgumentTypeError(f"{text!r} is not an origin; give scheme://host[:port] as the page's address "
                                         "begins, e.g. http://localhost:3000, with no path or trailing slash (or * for any)")
    default = {"http": 80, "https": 443}[parts.scheme]
    return f"{parts.scheme}://{parts.netloc.rsplit(':', 1)[0] if port == default else parts.netloc}"


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` for uvicorn to serve; what the system refuses is one line with the fix.

    It listens at once, not only when uvicorn starts: with SO_REUSEADDR Linux lets a second socket bind a port
    that another has bound but not yet listened on, so a second ``serve`` started while the first still loads
    would pass this check and fail at uvicorn's ``listen``. Connections made meanwhile wait for the model."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise BlockloopError(f"--host {host!r} is no address of this machine ({exc.strerror}); "
                             "use 127.0.0.1, 0.0.0.0 or one of its own names or addresses") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait
        sock.bind(address)
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as exc:
        sock.close()
        fix = {errno.EADDRINUSE: "another process listens there; stop it or pick another --port",
               errno.EACCES: "ports below 1024 need privileges; pick another --port",
               errno.EADDRNOTAVAIL: "--host is no address of this machine; use 127.0.0.1 or 0.0.0.0"}
        raise BlockloopError(f"cannot listen on {host}:{port}: {exc.strerror}; "
                             f"{fix.get(exc.errno, 'pick another --host or --port')}") from None
    return sock


def load(args: argparse.Namespace, n_slots: int) -> tuple[TrainedModel, dict[str, Any]]:
    """The checkpoint and the engine options the flags ask for (shared with ``blockloop chat``)."""
    from blockloop.device import resolve_device
    from blockloop.serve.runners import Paging
    from blockloop.serve.runners.paging import DEFAULT_PAGE_SIZE
    from blockloop.train.run import load_trained

    set_threads(args.threads)  # before the engine thread starts: it inherits the setting
    decoding = looped_decoding(args)
    trained = load_trained(args.checkpoint, resolve_device(args.device))
    if args.page_size is not None and not args.kv_tokens:
        raise BlockloopError("--page-size shapes the paged cache of --kv-tokens; add --kv-tokens N or leave it out")
    paging = Paging(args.kv_tokens, args.page_size or DEFAULT_PAGE_SIZE) if args.kv_tokens else None
    return trained, dict(n_slots=n_slots, max_len=args.max_len, sync_every=args.sync_every, **decoding,
                         compile=args.compile, prefill_chunk=args.prefill_chunk, paging=paging,
                         key_buckets=args.key_buckets)
