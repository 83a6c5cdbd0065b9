"""The staircase family in the serving engine: continuous batching (requests joining mid-batch into a
free slot while the others decode) gives the greedy tokens of the full forward pass."""

from __future__ import annotations

import pytest
import torch

from blockloop.families import build_model, from_name
from blockloop.serve.engine import Engine
from blockloop.serve.requests import RequestStatus, SamplingParams
from blockloop.serve.runners import runner_for

GREEDY = SamplingParams(temperature=0.0)
STAIRCASES = ["tiny-staircase", "tiny-cached-staircase", "tiny-global-staircase", "tiny-feedback"]
CONTINUOUS = ["tiny-ladder", "tiny-transformer-xl", *STAIRCASES]


def tiny(name: str) -> torch.nn.Module:
    """A float64 preset; "name:context" overrides the context length (a global cache's length)."""
    torch.manual_seed(0)
    preset, _, context = name.partition(":")
    model = build_model(from_name(preset, **({"context_length": int(context)} if context else {}))).double().eval()
    if getattr(model.config, "memory_mix", False):
        with torch.no_grad():  # a non-uniform mix, so the test sees the weights used
            model.memory_weights.copy_(torch.tensor([0.5, -1.0, 1.5], dtype=torch.float64))
    return model


def random_prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 258, (n,), generator=g).tolist() for n in lengths]


def full_forward_greedy(model, prompt, n):
    """Re-read the whole sequence with the training forward for every token: no cache, no batch."""
    idx = torch.tensor([prompt])
    for _ in range(n):
        logits = model(idx)[0]
        idx = torch.cat([idx, logits[:, -1, :258].argmax(-1, keepdim=True)], 1)
    return idx[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", CONTINUOUS)
def test_engine_with_mid_batch_joins_equals_full_forward_greedy(name):
    model = tiny(name)
    assert runner_for(model).per_slot
    # Prompt + generation reaches past Transformer-XL's span of 16, so its rings wrap, row by row.
    prompts = random_prompts((3, 14, 6, 5))
    budgets = [6, 4, 7, 5]
    engine = Engine(model, 2, sync_every=3)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts[:3], budgets[:3])]
    engine.step()
    assert [r.status for r in requests] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING]
    requests += [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts[3:], budgets[3:])]
    engine.run()
    assert [r.output for r in requests] == [full_forward_greedy(model, p, n) for p, n in zip(prompts, budgets)]


# tiny-global-staircase:22: a global cache of 22 entries, not a multiple of the chunk, that fills and slides.
@pytest.mark.parametrize("name", [*CONTINUOUS, "tiny-global-staircase:22"])
def test_slot_logits_equal_the_full_forward_when_a_slot_is_refilled_mid_decode(name):
    """Row 1 is refilled with a new request while row 0 keeps decoding past Transformer-XL's span of 16:
    every logit row from prefill_slot/decode_step equals that sequence's full forward."""
    model = tiny(name)
    sequences = random_prompts((24, 8, 18), seed=3)
    prompt_len = [4, 5, 6]
    runner = runner_for(model)
    runner.allocate(2, 24)
    got: list[list[torch.Tensor]] = [[], [], []]
    job, read = [0, 1], [0, 0]  # each row's request, and how many of its tokens it has read

    def prefill(row, j):
        job[row], read[row] = j, prompt_len[j]
        got[j].append(runner.prefill_slot(row, torch.tensor(sequences[j][: prompt_len[j]])))

    prefill(0, 0)
    prefill(1, 1)
    for t in range(20):
        if t == 3:  # row 1's request is done: the next takes its slot while row 0 decodes on
            prefill(1, 2)
        fed = [sequences[job[r]][min(read[r], len(sequences[job[r]]) - 1)] for r in range(2)]
        logits = runner.decode_step(torch.tensor(fed))
        for r in range(2):
            if read[r] < len(sequences[job[r]]):
                got[job[r]].append(logits[r])
            read[r] += 1
    for j, steps in enumerate(got):
        full = model(torch.tensor([sequences[j]]))[0][0]
        start = prompt_len[j] - 1
        torch.testing.assert_close(torch.stack(steps), full[start : start + len(steps)])


@pytest.mark.parametrize("name", [f"{s}:24" for s in STAIRCASES])
def test_a_staircase_streams_past_its_context(name):
    """A staircase's decode state has a fixed size and its positions are local to each window, so a request reads
    on past the model context (here 24 tokens; prompt and answer 46), as its training forward does over any length:
    generate() and an engine given a longer max_len give the full forward's greedy tokens. A model whose cache grows
    with the sequence is still held to its context."""
    from blockloop.errors import BlockloopError
    from blockloop.serve.generate import generate

    model = tiny(name)
    assert model.config.context_length == 24 and runner_for(model).streams
    prompts = random_prompts((30, 10), seed=5)
    expected = [full_forward_greedy(model, p, n) for p, n in zip(prompts, (16, 36))]
    assert generate(model, [prompts[1]], 36, temperature=0) == [expected[1]]
    engine = Engine(model, 2, max_len=48, sync_every=4)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, (16, 36))]
    engine.run()
    assert [r.output for r in requests] == expected
    with pytest.raises(BlockloopError, match=r"exceeds the engine's 48-token slots \(max_len; this model streams"):
        engine.submit(prompts[0], 19)
    vanilla = build_model(from_name("tiny", context_length=24)).eval()
    with pytest.raises(BlockloopError, match="max_len .--max-len. 48 is more than the model context of 24"):
        Engine(vanilla, 2, max_len=48)


def segment_greedy(model, prompt, n, segment):
    """The training forward over the stream, ``segment`` tokens at a time with the memory carried, for every token."""
    sequence = list(prompt)
    for _ in range(n):
        idx, state = torch.tensor([sequence]), None
        for start in range(0, len(sequence), segment):
            logits, _, state = model(idx[:, start : start + segment], state=state, return_state=True)
        sequence.append(int(logits[0, -1, :258].argmax()))
    return sequence[len(prompt):]


@pytest.mark.parametrize("name, fields", [("tiny-transformer-xl", {}), ("tiny-ladder", {"memory_len": 6})])
def test_a_model_with_a_memory_streams_past_its_context_on_rings_of_its_span(name, fields):
    """With a memory (attention span M), every layer application's cache is a ring of the M + 1 slots a query sees,
    and positions are rotary: a request reads on past the context (24 tokens; prompt and answer 46) with the
    tokens of the segment forward over the stream, and a row's cache holds M + 1 keys per application whatever
    its length."""
    from blockloop.serve.generate import generate

    torch.manual_seed(0)
    model = build_model(from_name(name, context_length=24, **fields)).double().eval()
    span = model.config.memory_len + 1
    assert runner_for(model).streams
    prompts = random_prompts((30, 10), seed=5)
    expected = [segment_greedy(model, p, n, 24) for p, n in zip(prompts, (16, 36))]
    assert expected[1] == segment_greedy(model, prompts[1], 36, 7)  # the segment length does not matter
    assert generate(model, [prompts[1]], 36, temperature=0) == [expected[1]]
    engine = Engine(model, 2, max_len=48, sync_every=4, prefill_chunk=5)  # chunks within a ring; generate: whole prompts
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, (16, 36))]
    engine.run()
    assert [r.output for r in requests] == expected
    for max_len in (48, 4096):
        cache = model.allocate_cache(2, max_len)
        assert all(layer.k.shape == (2, model.config.n_kv_head, span + 1, model.config.head_dim)  # and a scratch entry
                   for layer in cache.layers)
    assert not runner_for(build_model(from_name("tiny-ladder"))).streams  # no memory: a cache of the whole sequence


def test_generate_and_serve_take_a_staircase_past_its_context(tmp_path, capsys):
    """The CLI's default answer (200 tokens) is no longer cut to what the context leaves, and serve/chat take a
    --max-len above the context for a staircase (a decoder is still held to its context)."""
    from blockloop.cli import main
    from blockloop.errors import BlockloopError
    from blockloop.serve.http.worker import serving_engine

    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny-staircase", "--set", "context_length=24", "--seq-len", "24", "--steps", "1",
                 "--batch-size", "2", "--device", "cpu", "--no-progress", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run), "--prompt", "ROMEO:", "--temperature", "0", "--no-stop"]) == 0
    text = capsys.readouterr().out
    # 200 byte tokens decode to at least 50 characters (18 would have fit the context after the prompt)
    assert len(text) > 6 + 40, text
    for name in ("tiny-staircase:24", "tiny-transformer-xl:24"):
        assert serving_engine(tiny(name), 2, max_len=300).max_len == 300
    with pytest.raises(BlockloopError, match="more than the model context of 24"):
        serving_engine(build_model(from_name("tiny", context_length=24)).eval(), 2, max_len=300)
