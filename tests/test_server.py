"""The OpenAI-compatible server, driven by the official ``openai`` client over real HTTP: every family answers
completions and chats, streamed and not, exactly like ``blockloop generate``; 64 concurrent requests from 16
threads; stop strings; metrics that move; ``bench --url``; the ``serve`` verb itself."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from blockloop.cli import main
from blockloop.serve.generate import generate
from blockloop.serve.http.app import app_for
from blockloop.serve.http.chat import plain_template
from blockloop.serve.runners import ExitRule, Speculation
from blockloop.train.run import TrainedModel, load_trained
from server_helpers import metric, running, tiny_run

# name -> (preset, engine options): every family, and the looped model batched depth-wise and speculating too.
FAMILIES = {
    "vanilla": ("tiny", {}), "block": ("tiny-block", {}), "double": ("tiny-double", {}),
    "recursive": ("tiny-recursive", {}), "recursive-depthwise": ("tiny-recursive", {"exit_rule": ExitRule("none")}),
    "recursive-speculative": ("tiny-recursive", {"speculation": Speculation(2)}),
    "staircase": ("tiny-staircase", {}), "encdec": ("tiny-encdec", {}), "transformer-xl": ("tiny-transformer-xl", {}),
}


@dataclass
class Served:
    url: str
    name: str
    run: str
    reference: TrainedModel  # a separate copy of the served model, for in-process references
    client: openai.OpenAI


def serve(tmp_path_factory, preset: str, **options):
    run = tiny_run(tmp_path_factory.getbasetemp() / "serve-runs", preset)
    trained = load_trained(run)
    app = app_for(trained.model, trained.tokenizer, name=preset, directory=trained.directory, **options)
    return run, app


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    preset, options = FAMILIES[request.param]
    run, app = serve(tmp_path_factory, preset, n_slots=4, **options)
    with running(app) as url:
        yield Served(url, preset, str(run), load_trained(run), openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0))


@pytest.fixture(scope="module")
def vanilla(tmp_path_factory):
    run, app = serve(tmp_path_factory, "tiny", n_slots=16)
    with running(app) as url:
        yield Served(url, "tiny", str(run), load_trained(run), openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0))


def greedy(reference: TrainedModel, prompt_ids: list[int], n: int) -> list[int]:
    return generate(reference.model, [prompt_ids], n, temperature=0, eos_id=reference.tokenizer.eos_id)[0]


def test_greedy_completions_over_http_equal_blockloop_generate(served, capsys):
    tok = served.reference.tokenizer
    assert main(["generate", "--checkpoint", served.run, "--prompt", "ROMEO:", "--max-new-tokens", "12",
                 "--temperature", "0", "--device", "cpu"]) == 0
    cli = capsys.readouterr().out
    expected = greedy(served.reference, tok.encode("ROMEO:"), 12)
    whole = served.client.completions.create(model=served.name, prompt="ROMEO:", max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert "ROMEO:" + choice.text + "\n" == cli
    assert choice.finish_reason == ("length" if len(expected) == 12 else "stop")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        6, len(expected), 6 + len(expected))
    chunks = list(served.client.completions.create(model=served.name, prompt="ROMEO:", max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected)
    # Token ids work as the prompt too, as in the OpenAI API.
    by_ids = served.client.completions.create(model=served.name, prompt=tok.encode("ROMEO:"), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == choice.text


def test_a_seed_samples_the_same_text_over_http_as_in_blockloop_generate(vanilla, capsys):
    """One meaning of "seed N": `blockloop generate --seed N` (its first sample), a request with "seed": N and a
    chat's first answer sample the same stream. Before, generate mixed the seed with the row first."""
    texts = []
    for seed in (5, -3):
        assert main(["generate", "--checkpoint", vanilla.run, "--prompt", "ROMEO:", "--max-new-tokens", "16",
                     "--temperature", "1", "--seed", str(seed), "--no-stop", "--device", "cpu"]) == 0
        cli = capsys.readouterr().out
        reply = vanilla.client.completions.create(model=vanilla.name, prompt="ROMEO:", max_tokens=16, temperature=1,
                                                  seed=seed, extra_body={"ignore_eos": True})
        assert cli == "ROMEO:" + reply.choices[0].text + "\n"
        texts.append(cli)
    assert texts[0] != texts[1]


def test_greedy_chat_streamed_and_not_follows_the_plain_template(served):
    tok, template = served.reference.tokenizer, plain_template()
    messages = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "Who is there?"}]
    prompt = tok.encode(template.render(messages))
    expected = tok.decode(greedy(served.reference, prompt, 10)).split("\nUser:")[0]
    whole = served.client.chat.completions.create(model=served.name, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(prompt)
    chunks = list(served.client.chat.completions.create(model=served.name, messages=messages, max_tokens=10,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    # vLLM's answer prefix: the assistant's started turn continued, not a new one opened after it
    started = [*messages, {"role": "assistant", "content": "Stand,"}]
    prompt = tok.encode(template.render(started, False, continue_final=True))
    assert tok.decode(prompt).endswith("Assistant: Stand,")
    expected = tok.decode(greedy(served.reference, prompt, 10)).split("\nUser:")[0]
    continued = served.client.chat.completions.create(
        model=served.name, messages=started, max_tokens=10, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert continued.choices[0].message.content == expected and continued.usage.prompt_tokens == len(prompt)


def test_a_stop_string_ends_the_answer_before_it(served):
    tok = served.reference.tokenizer
    text = tok.decode(greedy(served.reference, tok.encode("JULIET:"), 24))
    stop = text[5:7] if len(text) >= 7 else "zz"
    expected = text[: text.find(stop)] if stop in text else text
    for stream in (False, True):
        answer = served.client.completions.create(model=served.name, prompt="JULIET:", max_tokens=24, temperature=0,
                                                  stop=[stop, "never printed"], stream=stream)
        choices = [c.choices[0] for c in answer] if stream else answer.choices
        assert "".join(c.text for c in choices) == expected
        assert choices[-1].finish_reason == ("stop" if stop in text or len(text) < 24 else "length")


def test_a_stream_sends_one_chunk_per_token_even_while_a_possible_stop_string_is_held_back(served):
    """As vLLM: a token whose text is held back (the first token's text ends with the stop string's first
    character) still gets its chunk, empty; ``bench --url`` times tokens by these chunks, and checks their count
    against ``usage``. Skipping empty chunks made it fail on any model whose text was not plain ASCII."""
    tok = served.reference.tokenizer
    tokens = greedy(served.reference, tok.encode("JULIET:"), 6)
    first = tok.decode(tokens[:1])
    if not first or tok.decode(tokens[:2]) == first:
        pytest.skip("this model's first answer token is no text of its own")
    chunks = list(served.client.completions.create(
        model=served.name, prompt="JULIET:", max_tokens=6, temperature=0, stop=[first[-1] + "\x00"], stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = [c.choices[0].text for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(tokens)
    assert len(text) == chunks[-1].usage.completion_tokens == 6 and "" in text, text


def test_models_lists_the_served_model_with_its_context(served):
    (card,) = served.client.models.list().data
    assert card.id == served.name and card.owned_by == "blockloop"
    assert card.max_model_len == served.reference.config.context_length
    assert card.prompt_multiple == getattr(served.reference.config, "block_len", 1)  # a block model's whole blocks


def test_bench_over_http_counts_a_block_models_prompts_in_whole_blocks(served, capsys):
    """A prompt that fits the context as it is but not once left-padded to whole blocks: bench --url refused it only
    when the server answered 400 at the warm-up (or, without one, partway through the run)."""
    L, context = getattr(served.reference.config, "block_len", 1), served.reference.config.context_length
    if L < 2:
        pytest.skip("prompts are not padded")
    prompt, new = context - 2 * L + 1, 2 * L - 1  # context tokens as they are, context + L - 1 padded
    assert main(["bench", "--url", served.url, "--requests", "2", "--prompt-range", f"{prompt},{prompt}",
                 "--tokens-range", f"{new},{new}", "--warmup", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"takes {context + L - 1} tokens (prompt and new tokens, its prompt left-padded to whole blocks of {L})" \
        in err, err


def test_early_exit_over_http_answers_as_the_engine_serving_the_same_rule(tmp_path_factory):
    """``--exit max_prob:0`` (every token leaves after its first loop) over HTTP: each greedy answer is the one an
    in-process depth-wise engine with the same rule gives, and the server's own runner counted every token leaving
    after one loop (this barely trained model's first-loop and full-depth answers agree, so the text alone cannot
    tell the rule was applied)."""
    from blockloop.serve.engine import Engine
    from blockloop.serve.requests import SamplingParams
    from blockloop.serve.runners import runner_for

    rule = ExitRule("max_prob", 0.0)
    run, app = serve(tmp_path_factory, "tiny-recursive", n_slots=4, exit_rule=rule)
    reference = load_trained(run)
    tok = reference.tokenizer
    runner = runner_for(reference.model, exit_rule=rule)
    engine = Engine(runner, 4)
    prompts = ["ROMEO:", "JULIET:", "First Citizen:"]
    requests = [engine.submit(tok.encode(p), 10, sampling=SamplingParams(temperature=0.0), eos_id=tok.eos_id)
                for p in prompts]
    engine.run()
    assert runner.mean_exit_loop() == 1.0
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        for prompt, request in zip(prompts, requests):
            answer = client.completions.create(model="tiny-recursive", prompt=prompt, max_tokens=10, temperature=0)
            assert answer.choices[0].text == tok.decode(request.output)
            assert answer.usage.completion_tokens == len(request.output)
    assert app.state.served.worker.engine.runner.mean_exit_loop() == 1.0  # the server's tokens left after one loop


def test_64_concurrent_requests_from_16_threads_all_succeed_with_exact_counts(vanilla):
    tok = vanilla.reference.tokenizer
    prompts = [f"{name}:" for name in ("ROMEO", "JULIET", "HAMLET", "OTHELLO", "LEAR", "PUCK", "IAGO", "ARIEL")]
    reference = {p: greedy(vanilla.reference, tok.encode(p), 8) for p in prompts}

    def one(i: int):
        prompt, n, stream = prompts[i % 8], 4 + i % 5, i % 2 == 1
        sampled = i % 4 == 3  # a quarter sample with a seed: the same seed gives the same text under any load
        kwargs = dict(temperature=0.9, seed=i % 3, top_k=20) if sampled else dict(temperature=0)
        extra = {"top_k": kwargs.pop("top_k")} if sampled else {}
        reply = vanilla.client.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=stream,
                                                  stream_options={"include_usage": True} if stream else None,
                                                  extra_body=extra, **kwargs)
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason, usage = [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage
        else:
            text, reason, usage = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
        return i, prompt, n, sampled, text, reason, usage

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(64)))
    assert len(results) == 64
    samples: dict[tuple, str] = {}
    for i, prompt, n, sampled, text, reason, usage in results:
        assert usage.prompt_tokens == len(tok.encode(prompt))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert reason == ("length" if usage.completion_tokens == n else "stop")
        if sampled:
            assert samples.setdefault((prompt, n, i % 3), text) == text
        else:
            expected = reference[prompt][:n]
            assert text == tok.decode(expected) and usage.completion_tokens == len(expected)


def test_bench_over_http_reports_a_server_error_in_one_line_and_takes_the_v1_address_serve_prints(vanilla, capsys):
    """A path the server does not serve: it answers 404 at ``/nope/v1/models``; httpx words it in two lines. The
    address ``serve`` prints, ending in ``/v1`` (the ``openai`` client's base URL), is the server's own."""
    assert main(["bench", "--url", vanilla.url + "/nope", "--requests", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "404 Not Found" in err, err
    assert main(["bench", "--url", vanilla.url + "/v1/", "--requests", "2", "--prompt-range", "4,8",
                 "--tokens-range", "2,3"]) == 0
    assert "2 requests" in capsys.readouterr().out


def test_bench_over_http_refuses_a_stream_past_the_servers_context_before_sending_it(vanilla, capsys):
    before = metric(httpx.get(vanilla.url + "/metrics").text, "blockloop_prompt_tokens_total")
    assert main(["bench", "--url", vanilla.url, "--requests", "4", "--prompt-range", "100,120",
                 "--tokens-range", "20,30"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "more than the server's context of 128; lower --prompt-range" in err, err
    assert metric(httpx.get(vanilla.url + "/metrics").text, "blockloop_prompt_tokens_total") == before


def test_metrics_count_tokens_requests_and_latencies(vanilla):
    before = httpx.get(vanilla.url + "/metrics").text
    replies = [vanilla.client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0)
               for p in ("a", "bc", "def")]
    after = httpx.get(vanilla.url + "/metrics").text

    def moved(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert moved("blockloop_generation_tokens_total") == sum(r.usage.completion_tokens for r in replies)
    assert moved("blockloop_prompt_tokens_total") == 1 + 2 + 3
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert moved(f"blockloop_{histogram}_count") == 3
    assert metric(after, "blockloop_slots") == 16 and metric(after, "blockloop_requests_running") == 0
    assert metric(after, "blockloop_slot_usage") == 0


def test_bench_over_http_streams_the_seeded_requests_and_reports_percentiles(vanilla, tmp_path, capsys):
    from blockloop.bench.stream import schedule

    record = tmp_path / "http.jsonl"
    argv = ["bench", "--url", vanilla.url, "--requests", "8", "--rate", "40", "--prompt-range", "4,8",
            "--tokens-range", "3,6", "--seed", "2", "--record", str(record)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "req/s" in out and "| ITL |" in out
    (row,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert row["kind"] == "http_stream" and row["requests"] == 8
    # like every recorded result, it names its machine, versions, date and the exact command
    assert {"client_device", "torch", "python", "date", "command"} <= set(row)
    assert row["output_tokens"] == int(schedule(8, 40.0, 3, 6, seed=2)[1].sum())  # EOS ignored: every budget in full
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(row[key]) == {"mean", "median", "p90", "p99"} and row[key]["p99"] >= row[key]["median"] >= 0
    assert row["requests_per_s"] == pytest.approx(8 / row["duration_s"])


def test_tokenize_gives_the_served_tokenizers_ids_with_and_without_the_prompts_specials(vanilla):
    tokenizer = vanilla.reference.tokenizer
    text = "ROMEO: what light through yonder window breaks?"
    for specials, expected in ((True, tokenizer.encode_prompt(text)), (False, tokenizer.encode(text))):
        reply = httpx.post(vanilla.url + "/tokenize", json={"prompt": text, "add_special_tokens": specials}).json()
        assert reply["tokens"] == expected and reply["count"] == len(expected) and reply["max_model_len"] == 128


def test_bench_over_http_cuts_its_prompts_with_the_servers_own_tokenizer(tmp_path_factory, monkeypatch):
    """A subword model must be sent subword prompts, the same ones the in-process stream cuts, not bytes."""
    import dataclasses

    from blockloop.bench import http_stream
    from blockloop.bench.stream import corpus_prompts
    from blockloop.data.tokenizers import build_tokenizer
    from blockloop.families import build_model, from_name

    tokenizer = build_tokenizer("smollm2")
    model = build_model(dataclasses.replace(from_name("tiny"), vocab_size=tokenizer.vocab_size,
                                            padded_vocab_size=tokenizer.vocab_size)).eval()
    sent = []
    send = http_stream._send_all
    monkeypatch.setattr(http_stream, "_send_all", lambda url, name, prompts, *a: sent.append(prompts) or send(url, name, prompts, *a))
    with running(app_for(model, tokenizer, name="subword", n_slots=4)) as url:
        metrics = http_stream.run_http_stream(url, requests=4, rate=float("inf"), prompt_range=(6, 10),
                                              tokens_range=(2, 3), seed=5)
    assert metrics["requests"] == 4
    assert sent == [corpus_prompts(tokenizer.vocab_size, 4, 6, 10, seed=5, tokenizer=tokenizer)]
    assert max(max(p) for p in sent[0]) > 255  # real subword ids, not bytes


def test_bench_over_http_says_when_no_server_answers(capsys):
    assert main(["bench", "--url", "http://127.0.0.1:9", "--requests", "2"]) == 2
    assert "no OpenAI-compatible server answers" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:abc", "--requests", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a valid URL" in err, err


def _serve_verb(run: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`blockloop serve` on ``run`` as its own process on a free port, answering /health; with its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "blockloop.cli", "serve", "--checkpoint", str(run), "--port",
                             str(port), "--log-level", "warning", "--device", "cpu", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "no start"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)


def test_the_serve_verb_answers_over_http_and_stops_on_ctrl_c(tmp_path_factory):
    run = tiny_run(tmp_path_factory.getbasetemp() / "serve-runs", "tiny")
    proc, url = _serve_verb(run, "--slots", "2")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        reply = client.completions.create(model=run.name, prompt="ROMEO:", max_tokens=5, temperature=0)
        assert reply.usage.prompt_tokens == 6
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    port = url.rsplit(":", 1)[1]
    assert f"serving {run.name} (decoder, 2 slots) at http://127.0.0.1:{port}/v1" in out


def test_the_serve_verb_says_when_it_batches_depth_wise(tmp_path_factory):
    run = tiny_run(tmp_path_factory.getbasetemp() / "serve-runs", "tiny-recursive")
    proc, url = _serve_verb(run, "--slots", "2", "--exit", "max_prob:0.9")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"serving {run.name} (recursive, 2 slots, depth-wise with exit max_prob:0.9) at {url}/v1" in out


@pytest.mark.parametrize("signals, wait", [(["SIGTERM"], "0"), (["SIGINT", "SIGINT"], "600")])
def test_a_stop_gives_requests_in_flight_the_shutdown_timeout_then_a_503(tmp_path_factory, signals, wait):
    """On SIGTERM (or Ctrl-C) the server lets the requests in flight run for --shutdown-timeout, then ends those
    left with a 503 that each client reads (a stream: as its last event), and exits 0 without a traceback; a
    second Ctrl-C ends them at once. Before, it waited for as long as they took, and a second Ctrl-C aborted it.
    A client that stalls halfway through sending its request gets the same 503 (before: its handler was cancelled
    5 s later, a bare 500 and a traceback)."""
    run = tiny_run(tmp_path_factory.getbasetemp() / "serve-runs", "tiny")
    proc, url = _serve_verb(run, "--slots", "1", "--shutdown-timeout", wait)
    stalled = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=120)
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"model\":")

    def ask(stream: bool) -> tuple[int, str]:
        body = {"model": run.name, "prompt": "ROMEO:", "max_tokens": 120, "ignore_eos": True, "stream": stream}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        return reply.status_code, reply.text

    try:
        with ThreadPoolExecutor(16) as pool:
            replies = [pool.submit(ask, stream) for stream in (False, True) * 8]
            deadline = time.monotonic() + 60
            while True:  # all sixteen in: one runs, the others wait for the slot (or are done)
                state = httpx.get(url + "/metrics").text
                held = metric(state, "blockloop_requests_running") + metric(state, "blockloop_requests_waiting")
                if held + sum(reply.done() for reply in replies) >= 16:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.05)
            started = time.monotonic()
            for name in signals:
                proc.send_signal(getattr(signal, name))
                time.sleep(0.5)
            out, err = proc.communicate(timeout=120)
            answers = [reply.result() for reply in replies]
            stalled_answer = b"".join(iter(lambda: stalled.recv(65536), b""))
    finally:
        proc.kill()
        stalled.close()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert time.monotonic() - started < 60
    assert stalled_answer.startswith(b"HTTP/1.1 503") and b"shutting_down" in stalled_answer, stalled_answer
    cut = [text for status, text in answers if "shutting_down" in text]
    assert cut and all(text.endswith("data: [DONE]\n\n") for text in cut if text.startswith("data:"))
    assert all(status == 503 for status, text in answers if text in cut and not text.startswith("data:"))
