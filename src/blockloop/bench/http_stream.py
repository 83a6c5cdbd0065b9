"""The request-stream benchmark over HTTP (``blockloop bench --url``), like ``vllm bench serve``: the requests of
:func:`~blockloop.bench.stream.run_stream` (the same corpus prompts as token ids, cut from the corpus as the
server's own tokenizer reads it through ``/tokenize``; the same Poisson arrivals and token budgets for the same
seed; greedy, EOS ignored) sent to a running ``blockloop serve`` as streamed
``/v1/completions``, each token's arrival taken from its server-sent event on the client. The statistics are
:func:`~blockloop.bench.metrics.serving_metrics`', so the in-process and HTTP figures differ only by what HTTP adds.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from blockloop.bench.metrics import Timing, serving_metrics
from blockloop.bench.stream import corpus_text, cut_prompts, schedule
from blockloop.errors import BlockloopError


def _bad_url(url: str, why: str) -> BlockloopError:
    return BlockloopError(f"--url {url!r} is not a valid URL ({why}); give one like http://127.0.0.1:8000")


def _first_line(exc: Exception) -> str:
    """An httpx error in one line: a status error goes on with a second line pointing to MDN."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _check_url(url: str) -> None:
    """Refuse an address no server could answer at (another scheme, no host, a port out of range) as a bad
    address, rather than reporting it as a server that does not answer."""
    parts = urlsplit(url)
    try:
        parts.port  # raises on a port that is not a number in [0, 65535]
    except ValueError as exc:
        raise _bad_url(url, str(exc)) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _bad_url(url, "not an http:// or https:// address with a host")


def base_url(url: str) -> str:
    """The server's root: the address ``serve`` prints (and the ``openai`` client takes) ends in ``/v1``, which the
    routes below already name."""
    url = url.rstrip("/")
    endpoint = url.find("/v1/")
    if endpoint >= 0:  # an endpoint (…/v1/completions) rather than the server: the routes are named below
        raise BlockloopError(f"--url {url} names an endpoint; give the server's address, {url[:endpoint]} (or "
                             f"{url[:endpoint]}/v1, as serve prints it)")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def api_headers() -> dict[str, str]:
    """The API key a server started with ``--api-key`` wants: ``$BLOCKLOOP_API_KEY`` (what ``serve`` reads), else
    ``$OPENAI_API_KEY`` (what the ``openai`` client and ``vllm bench serve`` send)."""
    key = os.environ.get("BLOCKLOOP_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def model_card(url: str) -> dict[str, Any]:
    """The served model's entry of ``GET /v1/models`` (its id names the model in every request)."""
    try:
        reply = httpx.get(url + "/v1/models", timeout=30, headers=api_headers())
        if reply.status_code == 401:
            sent = "the one sent is not it" if api_headers() else "none was sent"
            raise BlockloopError(f"the server at {url} wants an API key ({sent}); set BLOCKLOOP_API_KEY (or "
                                 "OPENAI_API_KEY) to the key it was started with")
        cards = reply.raise_for_status().json()["data"]
    except httpx.InvalidURL as exc:
        raise _bad_url(url, str(exc)) from None
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise BlockloopError(f"no OpenAI-compatible server answers at {url} ({_first_line(exc)}); start `blockloop serve` "
                             "first") from None
    if not cards or "id" not in cards[0]:
        raise BlockloopError(f"the server at {url} lists no model; bench --url drives `blockloop serve`")
    return cards[0]


def server_tokens(url: str, model: str, text: str, corpus: str = "given") -> list[int]:
    """``text`` as the served model's tokenizer reads it (no BOS: prompts are slices of one long text)."""
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    try:
        reply = httpx.post(url + "/tokenize", json=body, timeout=300, headers=api_headers())
        if reply.status_code == 400:  # a blockloop server whose tokenizer cannot read the text (a task model's words)
            reason = reply.json()["error"]["message"]
        else:
            return reply.raise_for_status().json()["tokens"]
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        raise BlockloopError(f"the server at {url} did not tokenize the corpus ({_first_line(exc)}); bench --url drives "
                             "`blockloop serve`") from None
    raise BlockloopError(f"the server at {url} cannot read the {corpus} corpus ({reason}); bench --url needs a model "
                         "of text: give --corpus another, or serve such a model")


def run_http_stream(
    url: str, *, requests: int, rate: float, prompt_range: tuple[int, int], tokens_range: tuple[int, int],
    corpus: str = "shakespeare", seed: int = 0, warmup: int = 1,
) -> dict[str, Any]:
    """Send the stream to ``url`` and measure it: TTFT, TPOT, ITL and E2E percentiles, tokens/s and requests/s.
    ``warmup`` requests of the stream are sent first, one at a time and untimed, as ``vllm bench serve``'s test
    request: a server's first requests pay its start-up costs, and a request it cannot serve fails the run
    before the stream starts."""
    if requests < 1:
        raise BlockloopError(f"--requests must be >= 1, got {requests}")
    _check_url(url)
    root = base_url(url)
    card = model_card(root)
    prompts = cut_prompts(server_tokens(root, card["id"], corpus_text(corpus), corpus), requests, *prompt_range, seed=seed)
    offsets, budgets = schedule(requests, rate, *tokens_range, seed=seed)
    multiple = card.get("prompt_multiple") if isinstance(card.get("prompt_multiple"), int) else 1
    need = max(-(-len(p) // multiple) * multiple + int(n) for p, n in zip(prompts, budgets))
    context = card.get("max_model_len")
    if isinstance(context, int) and need > context:  # refused now, not as a 400 partway through the run
        padded = f", its prompt left-padded to whole blocks of {multiple}" if multiple > 1 else ""
        raise BlockloopError(f"the stream's longest request takes {need} tokens (prompt and new tokens{padded}), more "
                             f"than the server's context of {context}; lower --prompt-range or --tokens-range")
    answers = asyncio.run(_send_all(root, card["id"], prompts, offsets.tolist(), budgets.tolist(), warmup))
    timings = [answer for answer in answers if isinstance(answer, Timing)]
    failures = [answer for answer in answers if isinstance(answer, Failure) and not answer.turned_away]
    if not timings and failures:
        raise BlockloopError(f"every request to {url} failed (the first: {failures[0].reason}); check that the "
                             "server is still running, then bench again")
    if not timings:
        raise BlockloopError(f"the server at {url} turned every request away (503: its queue was full); raise its "
                             "--max-waiting or --slots, or lower --rate")
    metrics = serving_metrics(timings)
    metrics.update(url=url, model=card["id"], rate=rate, requests_per_s=len(timings) / metrics["duration_s"],
                   rejected=len(answers) - len(timings) - len(failures), failed=len(failures), warmup=warmup,
                   first_failure=failures[0].reason if failures else None)
    return metrics


@dataclass(frozen=True)
class Failure:
    """A request that did not finish: turned away by a full queue (503), or failed (the connection lost, the
    server's error event, another status). A load test counts these beside the figures of the requests that
    finished, as ``vllm bench serve`` counts failed requests, rather than stopping at the first."""

    reason: str
    turned_away: bool = False


async def _send_all(url: str, model: str, prompts: list[list[int]], offsets: list[float], budgets: list[int],
                    warmup: int) -> list[Timing | Failure]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits, headers=api_headers()) as client:
        for i in range(warmup):  # a request that fails here would fail the stream's too: stop before timing it
            answer = await _one(client, model, prompts[i % len(prompts)], budgets[i % len(prompts)], time.perf_counter())
            if isinstance(answer, Failure) and not answer.turned_away:
                raise BlockloopError(f"the warm-up request to {url} failed ({answer.reason}); check the server, then "
                                     "bench again")
        start = time.perf_counter()
        return await asyncio.gather(*(_one(client, model, p, n, start + t) for p, n, t in zip(prompts, budgets, offsets)))


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, arrival: float
               ) -> Timing | Failure:
    """One streamed request sent at ``arrival``: the time each token's event reached the client, or why it did not
    finish."""
    await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    times: list[float] = []
    usage: dict[str, int] = {}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                return Failure(f"{reply.status_code}: {text[:300]}",
                               turned_away=reply.status_code == 503 and '"queue_full"' in text)
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Failure(f"the server's error event: {chunk['error']['message']}")
                if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                    times.append(time.perf_counter())
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:  # the server went away, or broke the stream
        return Failure(f"{type(exc).__name__}: {_first_line(exc)}")
    if not usage:
        return Failure("the stream ended without its usage event")
    if usage.get("completion_tokens") != len(times):
        raise BlockloopError(f"counted {len(times)} token events but the server reports {usage}; is this blockloop serve?")
    return Timing(arrival, times)
