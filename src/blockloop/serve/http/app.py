"""The OpenAI-compatible HTTP API over one engine: ``/v1/models`` (and ``/v1/models/{id}``), ``/v1/completions``,
``/v1/chat/completions``, ``/tokenize`` (as vLLM's), ``/health`` and ``/metrics`` (FastAPI; run it with uvicorn,
as ``blockloop serve`` does).

Handlers only check, enqueue and stream: each request becomes a :class:`~blockloop.serve.http.worker.Job`
whose events come back from the engine thread into an asyncio queue (``loop.call_soon_threadsafe``). A
streamed answer is server-sent events, one chunk per token and ``data: [DONE]`` at the end. A client that
goes away, mid-stream or while a whole answer is generated, cancels its job, and the engine frees the slot at
the next window. Every error is an
OpenAI-style JSON object (``{"error": {"message", "type", "param", "code"}}``): 4xx for a bad request; 503 with
``Retry-After`` when the waiting queue is full, and 503 without it while the server shuts down or its engine has
stopped; 500 when generation itself failed. A whole answer whose client went away ends with an empty 499 that
nobody reads.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from torch import nn

from blockloop.data.tasks.tokenizer import answer_length
from blockloop.data.tokenizers import Tokenizer
from blockloop.errors import BlockloopError
from blockloop.serve.batching import prompt_size
from blockloop.serve.engine import Engine
from blockloop.serve.http.chat import ChatTemplate, TemplateFailure, chat_template_for
from blockloop.serve.http.metrics import CONTENT_TYPE, ServerMetrics
from blockloop.serve.http.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    Sampling,
    TokenizeRequest,
    parse,
)
from blockloop.serve.http.text import TextStream
from blockloop.serve.http.worker import EngineWorker, Event, Job, QueueFull, serving_engine
from blockloop.serve.requests import SamplingParams

DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI default for /v1/completions; chat answers may fill the context
RETRY_AFTER_S = 1
BODY_FLOOR = 1 << 20  # bytes of a request body beside its text: the other fields, JSON's spaces, message wrappers
# /tokenize reads a text of any length, not one bound for the context (bench --url sends a megabyte of corpus):
# its body has a fixed bound instead.
TOKENIZE_BODY_LIMIT = 8 << 20  # bench --url's corpus text: a mebi-character (bench.stream.PROMPT_TEXT), JSON-escaped
TASK_WORD_CHARS = 64  # characters a task model's word is taken to span, in bounding a body
PARSE_ON_LOOP_BYTES = 1 << 16
DISCONNECT_POLL_S = 0.5  # how often a whole answer's handler checks that its client is still there


@dataclass
class ServedModel:
    """What the API serves: the model's public name, its tokenizer and chat template, and the engine's worker."""

    name: str
    tokenizer: Tokenizer
    template: ChatTemplate
    worker: EngineWorker


def create_app(served: ServedModel, *, allowed_origins: Sequence[str] = (), api_key: str | None = None) -> FastAPI:
    """The API for ``served``; the app starts the worker's thread on startup and stops it on shutdown. With
    ``api_key``, the API's paths answer only requests that carry it (:class:`RequireKey`).

    A browser page may call it from another origin only if that origin is in ``allowed_origins`` (``*``: any): a
    web chat front end on its own port needs it. Without it the server sends no CORS headers at all, so browsers keep
    pages from elsewhere from reading its answers, and from sending a request with a JSON content type at all (it
    needs a preflight)."""
    metrics = ServerMetrics(served.worker)
    engine, tokenizer = served.worker.engine, served.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.worker.start()
        yield
        served.worker.close()

    app = FastAPI(title="blockloop", lifespan=lifespan)
    if api_key is not None:  # inside CORS, which is added after it: a browser reads the 401 too
        app.add_middleware(RequireKey, key=api_key)
    if allowed_origins:  # preflights answered, and the API's replies (errors and streams too) carry the header
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "HEAD", "POST"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    app.state.served, app.state.metrics = served, metrics
    app.state.stopping = asyncio.Event()  # set when the server ends the requests left in flight (it is stopping)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        return JSONResponse(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                     code=code).body(), status_code=exc.status_code, headers=exc.headers)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        ok = served.worker.healthy
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    # One card for the server's life: what a client may ask of it, and when it started serving (as OpenAI's
    # ``created`` is fixed per model).
    card = {"id": served.name, "object": "model", "created": int(time.time()), "owned_by": "blockloop",
            "max_model_len": engine.longest_request, "vocab_size": engine.vocab_size,
            "prompt_multiple": engine.runner.prompt_multiple}  # a Block Transformer's prompts count in whole blocks

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [dict(card)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        _check_model(name)
        return dict(card)

    # No id stands for more than ``longest`` bytes (nor a character for fewer than one): a text longer than the
    # context times that (twice, for the decoded lengths of a non-byte-level vocabulary) cannot fit, and is refused
    # before the tokenizer spends seconds on it while the streams wait. A task's words are not bytes: not checked.
    longest = None if getattr(tokenizer, "task", None) else 2 * max(1, int(tokenizer.token_byte_lengths().max()))
    # Nor does a body need more than JSON's 6 bytes (a \u escape) per character of such a text, beside a
    # megabyte for the rest of the request: a larger one is refused while it arrives, not held in memory whole.
    app.state.body_limit = BODY_FLOOR + 6 * engine.max_len * (longest or TASK_WORD_CHARS)

    def _check_length(text: str, field: str) -> None:
        if longest is not None and len(text) > engine.max_len * longest:
            raise ApiError(400, f"{field} of {len(text)} characters is more than the server's context of "
                           f"{engine.max_len} tokens could hold; shorten it", param=field, code="context_length_exceeded")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        params = parse(CompletionRequest, await _body(request))
        _check_model(params.model)
        if isinstance(params.prompt, str):
            _check_length(params.prompt, "prompt")
            prompt = await _encode(tokenizer.encode_prompt, params.prompt, "prompt")
        else:
            prompt = params.prompt
            if not all(0 <= t < engine.vocab_size for t in prompt):
                raise ApiError(400, f"prompt token ids must lie in [0, {engine.vocab_size})", param="prompt")
        try:
            max_tokens = answer_length(tokenizer, params.max_tokens, "max_tokens")
        except BlockloopError as exc:
            raise ApiError(400, str(exc), param="max_tokens") from None
        return await _serve(request, params, prompt, "prompt", max_tokens,
                            TextStream(tokenizer, params.stops(), prompt=prompt), Reply(False, served.name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        params = parse(ChatRequest, await _body(request))
        _check_model(params.model)
        task = getattr(tokenizer, "task", None)  # a TaskTokenizer: the words of a state-tracking task
        if task is not None and served.template.source is None:
            raise ApiError(400, f"this model reads the words of task {task}, not text, so it cannot chat; send a "
                           "sequence of its words to /v1/completions", param="messages")
        try:
            # off the event loop: a template over thousands of messages holds up every stream while it renders
            text = await asyncio.to_thread(served.template.render,
                                           [{"role": m.role, "content": m.content} for m in params.messages],
                                           params.add_generation_prompt, continue_final=params.continue_final_message)
        except TemplateFailure as exc:  # the server's template is broken: no fault of the request
            raise ApiError(500, str(exc), kind="server_error") from None
        except BlockloopError as exc:  # the template refused these messages (its raise_exception)
            raise ApiError(400, str(exc), param="messages") from None
        _check_length(text, "messages")
        prompt = await _encode(tokenizer.encode, text, "messages")
        # ignore_eos also runs past the template's end-of-turn token (vLLM: generation config EOS ids included).
        turn_ends = [] if params.ignore_eos else served.template.stop_ids
        stream = TextStream(tokenizer, params.stops() + served.template.stop, turn_ends, prompt=prompt)
        return await _serve(request, params, prompt, "messages", params.token_limit(), stream, Reply(True, served.name))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        params = parse(TokenizeRequest, await _body(request, TOKENIZE_BODY_LIMIT))
        if params.model is not None:
            _check_model(params.model)
        encode = tokenizer.encode_prompt if params.add_special_tokens else tokenizer.encode
        tokens = await _encode(encode, params.prompt, "prompt")
        rest = {"count": len(tokens), "max_model_len": card["max_model_len"]}
        return Response(await asyncio.to_thread(_tokens_json, tokens, rest), media_type="application/json")

    async def _encode(encode: Callable[[str], list[int]], text: str, field: str) -> list[int]:
        """``text``'s ids, encoded off the event loop (a long text must not hold up the streams); text the
        tokenizer cannot read (a task model's unknown word) or that reads as no tokens at all is the client's
        mistake, a 400 naming ``field``."""
        try:
            ids = await asyncio.to_thread(encode, text)
        except BlockloopError as exc:
            raise ApiError(400, str(exc), param=field) from None
        if not ids:
            raise ApiError(400, f"{field} reads as no tokens under this model's tokenizer; give at least one token",
                           param=field)
        return ids

    def _check_model(name: str) -> None:
        if name != served.name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {served.name!r}",
                           param="model", code="model_not_found")

    async def _serve(request: Request, params: Sampling, prompt: list[int], field: str, max_tokens: int | None,
                     text: TextStream, reply: Reply) -> Response:
        room = engine.room(len(prompt))
        size = prompt_size(len(prompt), engine.runner.padded(len(prompt)), "prompt" if field == "prompt" else
                           "chat prompt") + ("" if field == "prompt" else " (the messages in the chat template)")
        if room < 1:
            raise ApiError(400, f"{size} leaves no room for an answer in {_limit(engine)}; shorten it", param=field,
                           code="context_length_exceeded")
        name = "max_completion_tokens" if getattr(params, "max_completion_tokens", None) is not None else "max_tokens"
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"{name} of {max_tokens} is more than the {room} tokens left of {_limit(engine)} "
                           f"after a {size}; lower it", param=name, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = room if reply.chat else min(DEFAULT_COMPLETION_TOKENS, room)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(event: Event) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop has closed (server shutting down)
                pass

        sampling = SamplingParams(params.temperature, params.top_k if params.top_k and params.top_k > 0 else None,
                                  params.top_p, seed=params.seed if params.seed is not None else secrets.randbits(31))
        job = Job(prompt, max_tokens, sampling, text, deliver,
                  eos_id=None if params.ignore_eos else tokenizer.eos_id)
        try:
            served.worker.submit(job)
        except QueueFull as exc:
            metrics.rejected.inc()
            raise ApiError(503, str(exc), kind="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except BlockloopError as exc:
            raise ApiError(503, str(exc), kind="server_error") from None
        if params.stream:
            usage = params.stream_options is not None and bool(params.stream_options.include_usage)
            return StreamingResponse(_stream(job, events, reply, usage), media_type="text/event-stream")
        pieces: list[str] = []
        event, checked = Event([]), time.monotonic()
        try:
            while event.finish_reason is None:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                    pieces += event.pieces
                except asyncio.TimeoutError:
                    pass
                # A whole answer writes nothing until it is done: only asking finds a client that went away.
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    if await request.is_disconnected():
                        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
                    checked = time.monotonic()
        finally:
            if event.finish_reason is None:  # the client went away, or the handler was cancelled
                served.worker.cancel(job)
        if event.finish_reason == "error":
            raise _failed(event)
        return JSONResponse(reply.completion("".join(pieces) + event.tail, event.finish_reason,
                                             event.prompt_tokens, event.completion_tokens))

    def _failed(event: Event) -> ApiError:
        """The error of a job that ended in one: 503 when the server stopped it (it is shutting down), else 500."""
        if served.worker.stopping is not None:
            return ApiError(503, event.tail, kind="server_error", code="shutting_down")
        return ApiError(500, f"generation failed: {event.tail}", kind="server_error")

    async def _stream(job: Job, events: asyncio.Queue, reply: Reply, usage: bool) -> AsyncIterator[str]:
        """Server-sent events of one job; leaving early (the client went away) cancels it."""
        done = False
        try:
            if reply.chat:
                yield _sse(reply.chunk("", first=True))
            while not done:
                event = await events.get()
                out = [_sse(reply.chunk(piece)) for piece in event.pieces]  # one per token, empty while text is held back
                if event.finish_reason == "error":
                    out.append(_sse(_failed(event).body()))
                elif event.finish_reason is not None:
                    out.append(_sse(reply.chunk(event.tail, event.finish_reason)))
                    if usage:
                        out.append(_sse(reply.usage_chunk(event.prompt_tokens, event.completion_tokens)))
                done = event.finish_reason is not None
                if done:
                    out.append("data: [DONE]\n\n")
                if out:
                    yield "".join(out)
        finally:
            if not done:
                served.worker.cancel(job)

    return app


def _limit(engine: Engine) -> str:
    """The limit a client knows as ``max_model_len``: the context, or the paged KV cache where it holds less."""
    return f"the {engine.longest_request} tokens a request may take on this server (max_model_len)"


async def _body(request: Request, limit: int | None = None) -> Any:
    """The request's JSON body, of at most ``limit`` bytes (default: what a request to the context could need). A
    client still sending it when the server stops (``app.state.stopping``) gets the 503 the engine's requests get
    then, rather than a handler cancelled mid-read: a bare 500 and a traceback."""
    reading = asyncio.ensure_future(_bounded_read(request, limit or request.app.state.body_limit))
    stopping = asyncio.ensure_future(request.app.state.stopping.wait())
    try:
        await asyncio.wait((reading, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled: no task left behind
        stopping.cancel()
        if not reading.done():
            reading.cancel()
    if not reading.done():  # the server stopped first (the read's cancel takes effect at its next step)
        raise ApiError(503, SHUTTING_DOWN, kind="server_error", code="shutting_down")
    try:
        raw = reading.result()
        # Parsing a body of megabytes takes the loop for milliseconds: off it, so the streams keep flowing.
        return await asyncio.to_thread(json.loads, raw) if len(raw) > PARSE_ON_LOOP_BYTES else json.loads(raw)
    except ClientDisconnect:  # gone before its whole body arrived: nobody reads the answer, and it is no bug
        raise ApiError(499, "the client closed the connection before sending its whole request") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply to read; flatten it") from None


async def _bounded_read(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to pass ``limit`` bytes: by its declared length before
    any of it is read, or, sent in chunks without one, at the chunk that passes it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is more than the {limit} bytes this server reads for its path; shorten "
                    "the text", code="request_too_large")


SHUTTING_DOWN = "the server is shutting down; send the request to another one, or again once it is back"


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def app_for(
    model: nn.Module, tokenizer: Tokenizer, *, name: str, directory: Path | None = None,
    chat_template: str | None = None, n_slots: int = 8, max_waiting: int = 256, allowed_origins: Sequence[str] = (),
    api_key: str | None = None, **engine_options: Any,
) -> FastAPI:
    """The API serving ``model`` (a checkpoint's model, tokenizer and folder, as ``blockloop serve`` loads them;
    ``chat_template``, Jinja text, replaces the checkpoint's; ``allowed_origins``, ``api_key``: see
    :func:`create_app`); ``engine_options`` go to :func:`~blockloop.serve.http.worker.serving_engine`."""
    template = chat_template_for(tokenizer, directory, chat_template)  # a broken template fails before the engine
    engine = serving_engine(model, n_slots, **engine_options)
    worker = EngineWorker(engine, max_waiting=max_waiting)
    return create_app(ServedModel(name, tokenizer, template, worker), allowed_origins=allowed_origins, api_key=api_key)


class RequireKey:
    """Answer the API's paths (``/v1/...``, ``/tokenize``) only for requests with ``Authorization: Bearer KEY``, as
    vLLM's ``--api-key``: a server listening beyond this machine would otherwise generate for anyone who reaches
    the port. ``/health`` and ``/metrics`` stay open for load balancers and scrapers, and CORS preflights (which
    carry no credentials) pass. Plain ASGI, not FastAPI's ``BaseHTTPMiddleware``, which would sit between a stream
    and its client's disconnect."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and (scope["path"].startswith("/v1/") or scope["path"] == "/tokenize")):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                error = ApiError(401, "this server needs its API key: send the header Authorization: Bearer KEY (the "
                                 "openai client's api_key)", kind="authentication_error", code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _tokens_json(tokens: list[int], rest: dict[str, Any]) -> bytes:
    """A ``/tokenize`` reply, written off the event loop and a piece at a time: a megabyte's ids through FastAPI's
    encoder (a Python walk of every int, on the loop) held every stream up for seconds, and one long C call would
    hold the GIL as long; between pieces the loop gets its turn."""
    step = 1 << 15
    ids = ",".join(",".join(map(str, tokens[i : i + step])) for i in range(0, len(tokens), step))
    return f'{{"tokens":[{ids}],{json.dumps(rest)[1:]}'.encode()
