"""The server under misuse: malformed requests each get an OpenAI-style 4xx naming the field and the server
keeps serving; a client that disconnects mid-stream frees its slot; a full waiting queue answers 503."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from blockloop.bench.http_stream import run_http_stream
from blockloop.cli import main
from blockloop.errors import BlockloopError
from blockloop.serve.http.app import app_for
from blockloop.train.run import load_trained
from server_helpers import metric, running, tiny_run

GOOD = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOKENIZE = {"model": "tiny", "prompt": "ROMEO:"}
BASE = {"/v1/completions": GOOD, "/v1/chat/completions": CHAT, "/tokenize": TOKENIZE}
LONG = "x" * 200  # more than the 128-token context of the tiny model
# (path, body: a dict to merge into GOOD / CHAT, or raw bytes, expected status, expected param)
MALFORMED = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"model": None}, 400, "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 500}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"n": 2}, 400, "n"),
    ("/v1/completions", {"stop": 7}, 400, "stop"),
    ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"stop": [""]}, 400, "stop"),
    ("/v1/completions", {"seed": "x"}, 400, "seed"),
    ("/v1/completions", {"stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"logprobs": 0}, 400, "logprobs"),  # the chosen tokens' log-probabilities, no alternatives
    ("/v1/completions", {"best_of": True}, 400, "best_of"),  # JSON true is not 1
    ("/v1/completions", {"echo": True}, 400, "echo"),
    ("/v1/completions", {"presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"min_p": 0.1}, 400, "min_p"),  # vLLM's extras are refused by name, not ignored
    ("/v1/completions", {"repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ("/v1/completions", {"allowed_token_ids": [120]}, 400, "allowed_token_ids"),  # would change the answer: refused
    ("/v1/completions", {"guided_choice": ["yes", "no"]}, 400, "guided_choice"),
    ("/v1/completions", {"truncate_prompt_tokens": 8}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"skip_special_tokens": False}, 400, "skip_special_tokens"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/v1/chat/completions", {"continue_final_message": True}, 400, "continue_final_message"),  # with the prompt's
    ("/v1/chat/completions", {"add_generation_prompt": "no"}, 400, "add_generation_prompt"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, 400, "stream_options"),  # without stream
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, 400, "tools"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("/tokenize", {"model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"max_tokens": 3}, 400, "max_tokens"),
    ("/v1/completions", json.dumps({**GOOD, "temperature": float("nan")}).encode(), 400, "temperature"),
    ("/v1/completions", json.dumps({**GOOD, "top_p": float("inf")}).encode(), 400, "top_p"),
    ("/v1/completions", {"top_k": 2**64}, 400, "top_k"),  # past what a slot's int64 holds
    ("/v1/completions", {"seed": -(2**63) - 1}, 400, "seed"),
    # JSON may escape a lone surrogate, which is no UTF-8 text (sent as bytes: a client cannot encode it)
    ("/v1/completions", json.dumps({**GOOD, "prompt": "\ud800abc"}).encode(), 400, "prompt"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "user", "content": "\udfff"}]}).encode(), 400,
     "messages[0].content"),
    ("/v1/completions", json.dumps({**GOOD, "stop": ["ok", "\ud800"]}).encode(), 400, "stop"),  # could never match
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),  # too deep to parse
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.getbasetemp() / "serve-runs", "tiny")


def app(run, **options):
    trained = load_trained(run)
    return app_for(trained.model, trained.tokenizer, name="tiny", directory=trained.directory, **options)


def test_an_api_key_guards_the_api_and_bench_sends_it(run, monkeypatch):
    """--api-key (vLLM's): every API path refuses a request without the key, or with another, in a 401 the openai
    client reads; /health and /metrics stay open; a preflight passes and a browser from an allowed origin reads the
    401; bench --url sends $BLOCKLOOP_API_KEY and says what to set when it is missing."""
    import openai

    page = "http://localhost:3000"
    with running(app(run, n_slots=1, api_key="s3cret", allowed_origins=[page])) as url:
        for path, body in BASE.items():
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
                refused = httpx.post(url + path, json=body, headers={"origin": page, **headers})
                assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
                assert refused.headers["access-control-allow-origin"] == page
            assert httpx.post(url + path, json=body, headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
        preflight = httpx.options(url + "/v1/completions", headers={"origin": page, "access-control-request-method": "POST"})
        assert preflight.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=2).usage.completion_tokens == 2
        for name in ("BLOCKLOOP_API_KEY", "OPENAI_API_KEY"):
            monkeypatch.delenv(name, raising=False)
        with pytest.raises(BlockloopError, match="wants an API key \\(none was sent\\); set BLOCKLOOP_API_KEY"):
            run_http_stream(url, requests=2, rate=math.inf, prompt_range=(4, 8), tokens_range=(2, 2))
        monkeypatch.setenv("OPENAI_API_KEY", "s3cret")
        measured = run_http_stream(url, requests=2, rate=math.inf, prompt_range=(4, 8), tokens_range=(2, 2))
        assert measured["requests"] == 2 and not measured.get("failed"), measured


def test_browsers_may_call_the_api_only_from_the_allowed_origins(run):
    """CORS: a web page from an allowed origin gets its preflight and every reply (answers, streams, errors) marked
    for it; another origin, or a server that allows none, gets no CORS header, so the browser refuses the page."""
    page = "http://localhost:3000"
    preflight = {"origin": page, "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type, authorization"}
    with running(app(run, n_slots=1, allowed_origins=[page])) as url:
        answered = httpx.options(url + "/v1/chat/completions", headers=preflight)
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == page
        assert "POST" in answered.headers["access-control-allow-methods"]
        for body, status in ((GOOD, 200), ({**GOOD, "stream": True}, 200), ({**GOOD, "max_tokens": -1}, 400)):
            reply = httpx.post(url + "/v1/completions", json=body, headers={"origin": page})
            assert reply.status_code == status and reply.headers["access-control-allow-origin"] == page, body
        elsewhere = httpx.options(url + "/v1/chat/completions", headers={**preflight, "origin": "http://elsewhere.test"})
        assert elsewhere.status_code == 400 and "access-control-allow-origin" not in elsewhere.headers
    with running(app(run, n_slots=1)) as url:
        reply = httpx.post(url + "/v1/completions", json=GOOD, headers={"origin": page})
        assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers
        assert httpx.options(url + "/v1/completions", headers=preflight).status_code == 405


def test_malformed_requests_each_get_a_4xx_naming_the_field_and_the_server_keeps_serving(run):
    assert len(MALFORMED) >= 20
    with running(app(run, n_slots=2)) as url:
        for path, change, status, param in MALFORMED:
            if isinstance(change, bytes):
                reply = httpx.post(url + path, content=change, headers={"content-type": "application/json"})
            else:
                reply = httpx.post(url + path, json={**BASE[path], **change})
            error = reply.json()["error"]
            assert (reply.status_code, error["param"]) == (status, param), (change, error)
            assert error["type"] == "invalid_request_error" and error["message"]
            assert "Value error" not in error["message"], error  # pydantic's prefix on a validator's own words
            if param is not None:
                assert param.split("[")[0] in error["message"], error
        nan = httpx.post(url + "/v1/completions", content=json.dumps({**GOOD, "temperature": float("nan")}),
                         headers={"content-type": "application/json"})
        assert "finite" in nan.json()["error"]["message"], nan.text  # not "should be less than or equal to 2"
        empty = httpx.post(url + "/v1/completions", json={**GOOD, "stop": [""]}).json()["error"]["message"]
        assert "empty stop string" in empty, empty  # not "give at most 4 non-empty stop strings"
        assert httpx.get(url + "/v1/nowhere").status_code == 404
        wrong_method = httpx.get(url + "/v1/completions")
        assert wrong_method.status_code == 405 and "error" in wrong_method.json()
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        good = httpx.post(url + "/v1/completions", json=GOOD).json()
        assert good["usage"]["completion_tokens"] >= 1 and good["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_chat_template_given_to_the_server_replaces_the_checkpoints(run):
    """``--chat-template``: the prompt a chat request becomes is the given template's text (one byte a token)."""
    with running(app(run, n_slots=1, chat_template="<{{ messages[-1].content }}>")) as url:
        reply = httpx.post(url + "/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "hey"}]})
        assert reply.json()["usage"]["prompt_tokens"] == len("<hey>")


def test_a_template_that_fails_is_the_servers_500_and_one_that_refuses_is_the_clients_400(run):
    """A template that breaks on a well-formed conversation is the server's to fix (500, server_error); its own
    raise_exception refusing a conversation is the client's (400 naming messages). Both were 400 before."""
    source = ("{% if messages[0].role != 'user' %}{{ raise_exception('start with a user message') }}{% endif %}"
              "{{ messages[1].content + 1 }}")
    with running(app(run, n_slots=1, chat_template=source)) as url:
        broken = httpx.post(url + "/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "a"}]})
        assert broken.status_code == 500 and broken.json()["error"]["type"] == "server_error", broken.text
        assert "the chat template failed on these messages" in broken.json()["error"]["message"]
        refused = httpx.post(url + "/v1/chat/completions",
                             json={**CHAT, "messages": [{"role": "assistant", "content": "a"}]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text
        assert "start with a user message" in refused.json()["error"]["message"]
        assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_null_optional_fields_mean_their_defaults_and_the_lesser_endpoints_answer(run):
    """Clients send ``null`` for fields they leave unset; ``/v1/models/{id}`` and ``HEAD /health`` are asked
    for by clients and health checkers."""
    nulls = {"temperature": None, "top_p": None, "n": None, "stop": None, "seed": None, "stream": None, "user": None,
             "echo": None, "logprobs": None, "min_p": None}
    unused = {"logprobs": False, "presence_penalty": 0.0, "top_logprobs": 0}  # "not used", as clients send it
    with running(app(run, n_slots=2)) as url:
        plain = httpx.post(url + "/v1/completions", json={**GOOD, "seed": 3}).json()
        nulled = httpx.post(url + "/v1/completions", json={**GOOD, **nulls, "seed": 3, "temperature": 0}).json()
        assert nulled["choices"][0]["text"] == plain["choices"][0]["text"]
        # unseeded sampling (seed null): ignore_eos, or an early end-of-text (about 1 run in 60) fails the count
        chat = httpx.post(url + "/v1/chat/completions", json={**CHAT, **nulls, **unused, "max_completion_tokens": None,
                                                             "ignore_eos": True})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
        assert httpx.post(url + "/v1/completions", json={**GOOD, "prompt": None}).json()["error"]["param"] == "prompt"
        unknown = httpx.post(url + "/tokenize", json={**TOKENIZE, "colour": "red"}).json()["error"]
        assert unknown["param"] == "colour" and "colour" in unknown["message"]
        card = httpx.get(url + "/v1/models/tiny").json()
        assert card["id"] == "tiny"
        time.sleep(1.1)  # a model's ``created`` is when the server started serving it, not when it is asked
        assert httpx.get(url + "/v1/models").json()["data"] == [card]
        missing = httpx.get(url + "/v1/models/gpt-4")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert httpx.head(url + "/health").status_code == 200


def slowed(application, seconds: float) -> None:
    """Make every engine window take at least ``seconds`` (a tiny model on CPU is otherwise done too soon)."""
    engine = application.state.served.worker.engine
    step = engine.step

    def slow_step(*args, **kwargs):
        time.sleep(seconds)
        return step(*args, **kwargs)

    engine.step = slow_step


def metrics_once_aborted(url: str) -> str:
    """``/metrics`` once a request has finished as aborted (or after a minute, for the assertions to report)."""
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(url + "/metrics").text
        if 'blockloop_requests_finished_total{finish_reason="abort"}' in text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(run):
    application = app(run, n_slots=1, sync_every=1)
    slowed(application, 0.02)
    with running(application) as url:
        body = {**GOOD, "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        text = metrics_once_aborted(url)  # the connection is closed: the engine cancels it at its next window
        assert metric(text, 'blockloop_requests_finished_total{finish_reason="abort"}') == 1
        assert metric(text, "blockloop_requests_running") == 0
        assert metric(text, "blockloop_generation_tokens_total") < 100
        after = httpx.post(url + "/v1/completions", json={**GOOD, "ignore_eos": True}).json()
        assert after["choices"][0]["finish_reason"] == "length"  # the one slot serves the next request


def test_a_client_that_disconnects_before_its_whole_answer_frees_its_slot(run):
    """A request without ``stream`` writes nothing until it is done, so the handler must notice the client left."""
    application = app(run, n_slots=1, sync_every=1)
    slowed(application, 0.02)
    with running(application) as url:
        body = {**GOOD, "max_tokens": 100, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)  # the client gives up and hangs up
        text = metrics_once_aborted(url)
        assert metric(text, 'blockloop_requests_finished_total{finish_reason="abort"}') == 1
        assert metric(text, "blockloop_generation_tokens_total") < 100


def test_a_full_waiting_queue_answers_503_with_retry_after(run):
    application = app(run, n_slots=1, max_waiting=1)
    engine = application.state.served.worker.engine
    gate, step = threading.Event(), engine.step
    engine.step = lambda *args, **kwargs: (gate.wait(60), step(*args, **kwargs))[1]
    with running(application) as url:
        streams = [httpx.stream("POST", url + "/v1/completions", json={**GOOD, "stream": True}) for _ in range(2)]
        with streams[0] as first, streams[1] as second:
            # The engine's window is held back: the first request will take the free slot, the second waits for
            # it, and one more would pass the bound of one waiting.
            refused = httpx.post(url + "/v1/completions", json=GOOD)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            assert metric(httpx.get(url + "/metrics").text, "blockloop_requests_waiting") == 2
            gate.set()
            for reply in (first, second):
                assert reply.read().decode().rstrip().endswith("data: [DONE]")
        assert httpx.post(url + "/v1/completions", json=GOOD).status_code == 200
        assert metric(httpx.get(url + "/metrics").text, "blockloop_requests_rejected_total") == 1


def test_bench_over_http_counts_requests_a_full_queue_turns_away_and_measures_the_rest(run, capsys):
    """Requests a full queue turns away (503) are counted, warned about and make the exit status 1: a run whose
    requests were mostly refused must not read as a clean one to a script."""
    application = app(run, n_slots=1, max_waiting=0)
    slowed(application, 0.02)  # the first request holds the only slot while the others arrive
    with running(application) as url:
        assert main(["bench", "--url", url, "--requests", "6", "--rate", "inf", "--prompt-range", "4,8",
                     "--tokens-range", "5,6", "--record", str(run.parent / "full.jsonl")]) == 1
        text = httpx.get(url + "/metrics").text
    (metrics,) = [json.loads(line) for line in (run.parent / "full.jsonl").read_text().splitlines()]
    assert metrics["requests"] >= 1 and metrics["rejected"] >= 1 and metrics["requests"] + metrics["rejected"] == 6
    assert metric(text, "blockloop_requests_rejected_total") == metrics["rejected"]
    err = capsys.readouterr().err
    assert f"warning: {metrics['rejected']} of 6 requests were turned away by the server's full queue (503)" in err
    assert "serve --max-waiting" in err


def test_bench_over_http_counts_the_requests_a_server_lost_mid_run_fails_and_reports_those_that_finished(run, capsys):
    """The server stops partway (its shutdown ends what it holds with an error event and answers later requests 503
    ``shutting_down``): the bench used to stop with an error and report nothing. The finished requests are measured;
    the others are counted as failed, as ``vllm bench serve`` counts them."""
    application = app(run, n_slots=1, sync_every=1)
    worker = application.state.served.worker
    step, windows = worker.engine.step, []

    def step_then_stop(*args, **kwargs):
        windows.append(1)
        if len(windows) == 12:  # the warm-up request and about two of the stream's have finished
            worker.stop("the server is shutting down")
        time.sleep(0.01)
        return step(*args, **kwargs)

    worker.engine.step = step_then_stop
    with running(application) as url:
        assert main(["bench", "--url", url, "--requests", "6", "--rate", "inf", "--prompt-range", "4,8",
                     "--tokens-range", "4,4", "--record", str(run.parent / "lost.jsonl")]) == 1
    out, err = capsys.readouterr()
    (row,) = [json.loads(line) for line in (run.parent / "lost.jsonl").read_text().splitlines()]
    assert row["requests"] >= 1 and row["failed"] >= 1 and row["requests"] + row["failed"] + row["rejected"] == 6
    assert row["output_tokens"] == 4 * row["requests"]  # the figures are the finished requests' own
    assert f"{row['failed']} failed" in out
    assert "requests failed (the first: " in err and "shutting down" in err, err

    stopped = app(run, n_slots=1)
    stopped.state.served.worker.stop("the server is shutting down")
    with running(stopped) as url:
        for warmup, says in (("0", "every request to"), ("1", "the warm-up request to")):
            assert main(["bench", "--url", url, "--requests", "2", "--prompt-range", "4,8", "--warmup", warmup]) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and says in err and "shutting down" in err, err


def test_bench_over_http_warms_the_server_before_its_clock_starts(run):
    """A server's first request pays its start-up costs (imitated by a one-second first window): timed, they made
    the run look slower than the server serves. ``warmup`` requests of the stream go first, untimed."""
    from blockloop.bench.http_stream import run_http_stream

    for warmup in (0, 1):
        application = app(run, n_slots=4)
        engine = application.state.served.worker.engine
        step, calls = engine.step, []

        def cold_step(*args, step=step, calls=calls, **kwargs):
            if not calls:
                time.sleep(1.0)
            calls.append(1)
            return step(*args, **kwargs)

        engine.step = cold_step
        with running(application) as url:
            metrics = run_http_stream(url, requests=4, rate=float("inf"), prompt_range=(4, 8), tokens_range=(3, 4),
                                      warmup=warmup)
            finished = metric(httpx.get(url + "/metrics").text, 'blockloop_requests_finished_total{finish_reason="length"}')
        assert metrics["requests"] == 4 and metrics["warmup"] == warmup and finished == 4 + warmup
        assert (metrics["e2e_s"]["p99"] >= 1.0) == (warmup == 0), metrics["e2e_s"]


def test_a_request_admitted_in_this_window_is_not_counted_as_waiting(run):
    """A request the engine admitted was counted as waiting until its first window ended, and as taking a slot
    too: with a free slot and no waiting allowed, a second request got a 503."""
    application = app(run, n_slots=2, max_waiting=0, sync_every=1)
    engine = application.state.served.worker.engine
    step = engine.step
    engine.step = lambda *args, **kwargs: (step(*args, **kwargs), time.sleep(0.5))[0]  # long windows
    with running(application) as url:
        body = {**GOOD, "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body):
            deadline = time.monotonic() + 30
            while metric(httpx.get(url + "/metrics").text, "blockloop_requests_running") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # The first request holds one slot, inside its first window; the second takes the other.
            assert metric(httpx.get(url + "/metrics").text, "blockloop_requests_waiting") == 0
            second = httpx.post(url + "/v1/completions", json=GOOD, timeout=60)
            assert second.status_code == 200, second.text
            # leaving without reading the rest cancels the first request
        assert metric(httpx.get(url + "/metrics").text, "blockloop_requests_rejected_total") == 0


def test_serve_rejects_an_exit_rule_for_a_model_without_loops(run, capsys):
    assert main(["serve", "--checkpoint", str(run), "--exit", "max_prob:0.9", "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the decoder family's runner has no option exit_rule (--exit; the " \
        "recursive family takes it)" in err
    # serve and chat speculate too (only generate and bench did), with the same refusals as generate
    for argv, message in [(["--speculate", "2"], "the decoder family's runner has no option speculation (--speculate;"),
                          (["--exit", "none", "--speculate", "2"], "--exit and --speculate are two decode modes"),
                          (["--draft-loops", "2"], "--draft-loops and --adaptive-k shape speculation; add --speculate K")]:
        for verb in ("serve", "chat"):
            assert main([verb, "--checkpoint", str(run), *argv, "--device", "cpu", *(["--port", "0"] * (verb == "serve"))]) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and message in err, err


def test_a_paged_cache_smaller_than_the_context_bounds_max_tokens_with_a_400(run):
    """With 64 cache tokens on a 128-token context the pool, not the context, is the limit: a request past it
    gets a 400 naming max_tokens (it used to pass the check and fail with a 500), and a chat without max_tokens
    gets what the pool holds."""
    from blockloop.serve.runners import Paging

    application = app(run, n_slots=2, paging=Paging(64, page_size=16))
    engine = application.state.served.worker.engine
    prompt = "ROMEO:"
    room = engine.room(len(application.state.served.tokenizer.encode_prompt(prompt)))
    assert 0 < room < 64
    with running(application) as url:
        too_many = httpx.post(url + "/v1/completions", json={**GOOD, "prompt": prompt, "max_tokens": room + 1})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens", too_many.text
        body = {**GOOD, "prompt": prompt, "max_tokens": room, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body).json()["usage"]["completion_tokens"] == room
        chat = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": None, "ignore_eos": True})
        assert chat.status_code == 200, chat.text
        # /v1/models says what one request can take (bench --url checks its stream by it): the pool, not the context
        longest = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
        assert longest < 128
        body = {**GOOD, "prompt": [7], "max_tokens": longest - 1, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body).json()["usage"]["completion_tokens"] == longest - 1
        refused = httpx.post(url + "/v1/completions", json={**body, "max_tokens": longest})
        assert refused.status_code == 400
        # the message names the limit the client knows (max_model_len), not the context the pool cuts short
        assert f"{longest} tokens a request may take on this server (max_model_len)" in refused.json()["error"]["message"]
        assert "128" not in refused.json()["error"]["message"]


def test_metrics_show_the_share_of_a_paged_cache_held_and_no_such_gauge_without_one(run):
    """What bounds admissions over a paged cache is its free pages: the gauge rises while a request holds pages and
    falls to 0 when it finishes. A static cache has no such number."""
    from blockloop.serve.runners import Paging

    with running(app(run, n_slots=2)) as url:
        assert "blockloop_kv_cache_usage" not in httpx.get(url + "/metrics").text
    application = app(run, n_slots=2, paging=Paging(64, page_size=16))
    engine = application.state.served.worker.engine
    step = engine.step
    engine.step = lambda *args, **kwargs: (step(*args, **kwargs), time.sleep(0.3))[0]  # long windows
    with running(application) as url:
        assert metric(httpx.get(url + "/metrics").text, "blockloop_kv_cache_usage") == 0
        body = {**GOOD, "max_tokens": 20, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            next(lines)  # the first token: the request holds its pages
            held = metric(httpx.get(url + "/metrics").text, "blockloop_kv_cache_usage")
            assert held in (1 / 4, 2 / 4)  # 6 prompt tokens and a window: one or two of the 4 pages of 16
            assert [line for line in lines if line][-1] == "data: [DONE]"
        assert metric(httpx.get(url + "/metrics").text, "blockloop_kv_cache_usage") == 0


def test_prefill_only_windows_add_no_generated_tokens_to_the_metrics(run):
    """A prompt longer than the prefill chunk takes windows that generate nothing; the last window's tokens used
    to be counted again for each of them."""
    with running(app(run, n_slots=2, prefill_chunk=4)) as url:
        body = {**GOOD, "prompt": "ROMEO: But soft, what light", "max_tokens": 3, "ignore_eos": True}
        usage = [httpx.post(url + "/v1/completions", json=body).json()["usage"]["completion_tokens"] for _ in range(3)]
        assert metric(httpx.get(url + "/metrics").text, "blockloop_generation_tokens_total") == sum(usage) == 9


def test_a_client_gone_before_its_whole_body_arrived_is_no_server_error(run):
    """Reading the body of a client that hung up mid-request raised out of the handler, logged as an ASGI error."""
    import logging
    import socket

    class Errors(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.ERROR)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    errors = Errors()
    with running(app(run, n_slots=1)) as url:
        logging.getLogger("uvicorn.error").addHandler(errors)  # after uvicorn configured its loggers (no root)
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100\r\n\r\n{\"model\": ")
            client.shutdown(socket.SHUT_WR)
            client.settimeout(10)
            assert client.recv(4096) == b""  # nobody answers a client that is gone
        assert httpx.get(url + "/health").json() == {"status": "ok"}
    logging.getLogger("uvicorn.error").removeHandler(errors)
    assert not [m for m in errors.messages if "Exception in ASGI application" in m]


def test_ignore_eos_also_runs_past_the_templates_end_of_turn_token(run):
    """As vLLM's ignore_eos: the chat template's end-of-turn ids stop an answer only without it."""
    application = app(run, n_slots=1)
    body = {**CHAT, "temperature": 0, "ignore_eos": True}
    with running(application) as url:
        free = httpx.post(url + "/v1/chat/completions", json=body).json()
        first = free["choices"][0]["message"]["content"][0]
        assert first.isascii()  # a byte token: its id is its code
        application.state.served.template.stop_ids = [ord(first)]  # as if the template's end-of-turn token
        stopped = httpx.post(url + "/v1/chat/completions", json={**body, "ignore_eos": False}).json()
        assert (stopped["choices"][0]["finish_reason"], stopped["choices"][0]["message"]["content"]) == ("stop", "")
        again = httpx.post(url + "/v1/chat/completions", json=body).json()
        assert again["choices"][0]["message"]["content"] == free["choices"][0]["message"]["content"]
        assert again["usage"]["completion_tokens"] == 4


def test_a_taken_port_or_a_foreign_host_is_one_line_before_the_model_loads(capsys):
    import socket

    from blockloop.cli import EXIT_USER_ERROR, main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the checkpoint does not exist: the address is checked first, so the error is the port's
        assert main(["serve", "--checkpoint", "/no/such/run", "--port", str(port)]) == EXIT_USER_ERROR
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [f"blockloop serve: error: cannot listen on 127.0.0.1:{port}: Address already in use; "
                                    "another process listens there; stop it or pick another --port"]
    assert main(["serve", "--checkpoint", "/no/such/run", "--host", "999.1.1.1"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--host '999.1.1.1' is no address of this machine" in err, err


def test_a_port_another_serve_holds_while_its_model_loads_is_refused_at_once():
    from blockloop.cli.serve import bind

    first = bind("127.0.0.1", 0)  # a serve still loading its model: bound, uvicorn not started
    try:
        with pytest.raises(BlockloopError, match="Address already in use; another process listens there"):
            bind("127.0.0.1", first.getsockname()[1]).close()
    finally:
        first.close()


def test_a_task_models_unknown_words_empty_prompts_and_chats_are_400s(tmp_path):
    """A state-tracking task model reads only its task's words: a prompt of other words, one of only spaces (no
    tokens), and any chat (the plain template writes "User:") were 500s with a traceback in the log."""
    run = tmp_path / "walk"
    assert main(["train", "--task", "random-walk:8", "--out", str(run), "--preset", "tiny", "--seq-len", "18",
                 "--steps", "2", "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1",
                 "--warmup-steps", "1", "--device", "cpu", "--no-progress"]) == 0
    trained = load_trained(run)
    with running(app_for(trained.model, trained.tokenizer, name="walk", directory=trained.directory, n_slots=1)) as url:
        for path, body, param, words in [
            ("/v1/completions", {"prompt": "r0c0 hello"}, "prompt", "'hello' is not a word of task random-walk:8"),
            ("/v1/completions", {"prompt": "   "}, "prompt", "no tokens"),
            ("/tokenize", {"prompt": "hello"}, "prompt", "'hello' is not a word"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "r0c0"}]}, "messages", "cannot chat"),
        ]:
            reply = httpx.post(url + path, json={"model": "walk", **({} if path == "/tokenize" else {"max_tokens": 2}),
                                                 **body})
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == param and words in reply.json()["error"]["message"]
        # One label answers a sequence: it was fed back as a word and the rest of the "continuation" was noise.
        for asked in ({"max_tokens": 1}, {}):
            good = httpx.post(url + "/v1/completions", json={"model": "walk", "prompt": "r0c0 L", **asked})
            assert good.status_code == 200 and good.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 1,
                                                                         "total_tokens": 3}
        more = httpx.post(url + "/v1/completions", json={"model": "walk", "prompt": "r0c0 L", "max_tokens": 2})
        assert more.status_code == 400 and more.json()["error"]["param"] == "max_tokens"
        assert "one label, the state after the last word; ask for max_tokens 1" in more.json()["error"]["message"]
        # bench --url says why it cannot stream Shakespeare to it (it blamed the server for not being blockloop's)
        with pytest.raises(BlockloopError, match=r"cannot read the shakespeare corpus \(.* is not a word of task "
                           r"random-walk:8.*\); bench --url needs a model of text"):
            run_http_stream(url, requests=2, rate=math.inf, prompt_range=(4, 8), tokens_range=(2, 2))


def test_a_text_too_long_for_any_tokenization_is_refused_before_the_tokenizer_reads_it(run):
    """No id of the byte tokenizer covers more than a byte: a prompt of more than twice the context's 128 in
    characters cannot fit, and is refused unread (a 50 MB prompt held every stream up while it was tokenized)."""
    application = app(run, n_slots=1)
    tokenizer = application.state.served.tokenizer
    read: list[int] = []
    original = tokenizer.encode  # encode_prompt reads through it too
    tokenizer.encode = lambda text: read.append(len(text)) or original(text)
    with running(application) as url:
        for path, field, body in (("/v1/completions", "prompt", {**GOOD, "prompt": "x" * 257}),
                                  ("/v1/chat/completions", "messages",
                                   {**CHAT, "messages": [{"role": "user", "content": "x" * 257}]})):
            error = httpx.post(url + path, json=body).json()["error"]
            assert (error["param"], error["code"]) == (field, "context_length_exceeded"), error
            assert "characters is more than the server's context of 128 tokens could hold" in error["message"]
        assert read == []
        long = httpx.post(url + "/v1/completions", json={**GOOD, "prompt": "x" * 200}).json()["error"]
        assert read == [200] and long["code"] == "context_length_exceeded"  # read, then refused by its tokens


def test_a_body_larger_than_any_request_could_need_is_a_413_declared_or_chunked(run):
    """A request body is bounded by what the context could hold (a megabyte beside 6 bytes per character of the
    longest text that fits): past it, a 413 while it arrives, whether its length is declared or it comes in chunks
    without one, rather than gigabytes held in memory; the server keeps serving."""
    application = app(run, n_slots=1)
    limit = application.state.body_limit
    assert limit == (1 << 20) + 6 * 128 * 2  # the tiny model: 128 tokens of at most a byte, twice over
    padding = b" " * limit  # JSON's spaces: a well-formed body, only too long

    def chunks():
        yield b'{"model": "tiny", "prompt": "hi",'
        for start in range(0, len(padding), 1 << 16):
            yield padding[start:start + (1 << 16)]
        yield b' "max_tokens": 2}'

    with running(application) as url:
        for content in (b'{"model": "tiny", "prompt": "hi",' + padding + b"}", chunks()):
            answer = httpx.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"})
            assert answer.status_code == 413, answer.text
            assert f"more than the {limit} bytes" in answer.json()["error"]["message"]
        fits = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}' + b" " * (limit // 2)
        assert httpx.post(url + "/v1/completions", content=fits).status_code == 200  # parsed off the loop
        # /tokenize reads any text, not only one the context holds: bench --url sends it a megabyte of corpus
        corpus = "to be or not to be " * 100_000
        reply = httpx.post(url + "/tokenize", json={"prompt": corpus}).json()  # its JSON written off the loop
        assert reply["count"] == len(corpus) and reply["tokens"] == load_trained(run).tokenizer.encode(corpus)
        assert reply["max_model_len"] == 128
        # ... and at most the most a corpus text bench sends can take, each character escaped (\uXXXX)
        from blockloop.bench.stream import PROMPT_TEXT
        from blockloop.serve.http.app import TOKENIZE_BODY_LIMIT

        assert 6 * PROMPT_TEXT + 1024 < TOKENIZE_BODY_LIMIT
        answer = httpx.post(url + "/tokenize", content=b'{"prompt": "hi",' + b" " * TOKENIZE_BODY_LIMIT + b"}")
        assert answer.status_code == 413, answer.text
        assert httpx.get(url + "/health").status_code == 200
