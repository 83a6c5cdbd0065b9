"""The engine hooks the HTTP server needs: cancelling a request frees its slot at the next window, a token
callback that finishes its request (a stop string) ends it like EOS, and ``room`` says what still fits."""

from __future__ import annotations

import pytest
import torch

from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name
from blockloop.serve.engine import Engine
from blockloop.serve.generate import generate
from blockloop.serve.requests import RequestStatus, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def tiny(name: str = "tiny"):
    torch.manual_seed(0)
    return build_model(from_name(name)).double().eval()


def test_cancelling_a_running_request_frees_its_slot_for_the_next_window():
    model = tiny()
    engine = Engine(model, 1, sync_every=2)
    first = engine.submit([5, 6, 7], 40, sampling=GREEDY)
    second = engine.submit([9, 10], 6, sampling=GREEDY)
    engine.step()
    assert first.status is RequestStatus.RUNNING and second.status is RequestStatus.WAITING
    done = len(first.output)
    engine.cancel(first)
    engine.step()
    assert first.finish_reason == "abort" and len(first.output) == done  # nothing more reaches a cancelled request
    assert second.status is RequestStatus.RUNNING and second.slot == 0
    engine.run()
    assert second.output == generate(model, [[9, 10]], 6, temperature=0)[0]  # the freed slot serves cleanly


def test_cancelling_a_waiting_request_takes_it_off_the_queue():
    engine = Engine(tiny(), 1, sync_every=2)
    running = engine.submit([1, 2], 3, sampling=GREEDY)
    waiting = engine.submit([3, 4], 3, sampling=GREEDY)
    engine.cancel(waiting)
    engine.cancel(waiting)  # a second cancel is a no-op
    engine.run()
    assert waiting.finish_reason == "abort" and waiting.output == [] and running.finish_reason == "length"
    assert engine.idle


def test_a_callback_that_finishes_its_request_ends_it_and_frees_the_slot():
    model = tiny("tiny-block")  # whole blocks per window: the stop lands inside a window
    reference = generate(model, [[5, 6, 7]], 20, temperature=0)[0]

    def stop_after_five(request, token):
        if len(request.output) == 5:
            request.finish("stop", 0.0)

    engine = Engine(model, 1, sync_every=8)
    first = engine.submit([5, 6, 7], 20, sampling=GREEDY, on_token=stop_after_five)
    second = engine.submit([9, 10], 4, sampling=GREEDY)
    engine.run()
    assert first.finish_reason == "stop" and first.output == reference[:5]
    assert second.slot == 0 and second.output == generate(model, [[9, 10]], 4, temperature=0)[0]


def test_room_is_what_the_submit_check_allows():
    engine = Engine(tiny("tiny-block"), 1, max_len=64)
    assert engine.room(5) == 64 - 8  # prompts are padded to whole blocks of 4
    engine.submit(list(range(1, 6)), engine.room(5))
    with pytest.raises(BlockloopError, match="exceeds"):
        engine.submit(list(range(1, 6)), engine.room(5) + 1)


def test_an_idle_static_batch_engine_steps_to_nothing():
    """A continuous engine's idle step returns no tokens; a static-batch one used to fail on an empty batch."""
    from blockloop.serve.runners import runner_for

    model = tiny("tiny-double")
    engine = Engine(runner_for(model, prefix=model.cache_prefix([1, 2, 3])), 2)  # a shared prefix: static batches
    assert not engine.continuous and engine.idle and engine.step() == []


def test_a_job_queued_while_the_engine_fails_is_answered_with_the_error():
    """A job the worker accepted while the failing step ran was left in the inbox unanswered (an HTTP client
    would wait forever); every job, running or queued, now gets the error, and later submits are refused."""
    import queue
    import threading

    from blockloop.serve.http.worker import EngineWorker, Job, serving_engine

    class Text:  # what a job's TextStream does, for plain token ids
        stopped = False

        def push(self, token: int) -> str:
            return "x"

        def flush(self) -> str:
            return ""

    engine = serving_engine(tiny(), 1, sync_every=2)
    in_step, go = threading.Event(), threading.Event()

    def failing_step(*args, **kwargs):
        in_step.set()
        go.wait(10)
        raise RuntimeError("out of memory (simulated)")

    engine.step = failing_step
    worker = EngineWorker(engine)
    worker.start()
    first, second = queue.Queue(), queue.Queue()
    worker.submit(Job([1, 2, 3], 4, GREEDY, Text(), first.put))
    assert in_step.wait(10)
    worker.submit(Job([1, 2, 3], 4, GREEDY, Text(), second.put))  # accepted: the worker is still healthy
    go.set()
    worker.thread.join(10)
    for events in (first, second):
        event = events.get(timeout=5)
        assert event.finish_reason == "error" and "out of memory (simulated)" in event.tail
    with pytest.raises(BlockloopError, match="the engine is not running"):
        worker.submit(Job([1, 2, 3], 4, GREEDY, Text(), first.put))


def test_a_compiling_server_engine_compiles_every_decode_graph_before_its_first_request(monkeypatch, capsys):
    """``serve --compile`` / ``chat --compile``: no request waits for a compile (on a GPU, tens of seconds a graph);
    the graphs (one per row count, one more per key length of a full step) are all made when the engine is built,
    and the tokens are the eager engine's."""
    from blockloop import progress
    from blockloop.serve.http.worker import serving_engine

    graphs, compile = [], torch.compile

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda f, **kw: compile(f, backend=counting, dynamic=False))
    model, prompts = tiny(), [[5, 6, 7], [9, 10, 11, 12, 13], [3]]
    outputs = []
    monkeypatch.setattr(progress, "_enabled", True)  # a CLI test's --no-progress may have turned bars off
    for compiled in (True, False):
        engine = serving_engine(model, 2, max_len=64, sync_every=2, compile=compiled)
        made = len(graphs)
        requests = [engine.submit(p, 20, sampling=GREEDY) for p in prompts]
        engine.run()
        assert len(graphs) == made
        outputs.append([r.output for r in requests])
    torch._dynamo.reset()
    assert made == len(engine.row_counts) + len(engine.key_lengths) - 1 == 1 + 4  # 1 row; 2 rows at 16, 32, 48, 64
    assert outputs[0] == outputs[1]
    assert "compiling decode steps: 5/5 graph" in capsys.readouterr().err  # a plain line where no bar is drawn
