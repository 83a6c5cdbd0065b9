"""The serving engine: continuous batching equals reference generation for every family, per-request
sampling, slot reuse, per-row cache slots, serving metrics, and the bench CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from blockloop.bench.metrics import Timing, serving_metrics, summarize
from blockloop.bench.records import pareto_front
from blockloop.cli import main
from blockloop.errors import BlockloopError
from blockloop.families import PRESETS, build_model, from_name, spec_of
from blockloop.nn.kv_cache import DecoderCache
from blockloop.serve.engine import Engine, default_sync_every
from blockloop.serve.generate import generate
from blockloop.serve.requests import RequestStatus, SamplingParams
from blockloop.serve.runners import ExitRule, Paging, Speculation, runner_for
from blockloop.serve.runners.base import row_buckets
from blockloop.serve.sampling import SlotSampling, sample_rows
from small_presets import small_variant

GREEDY = SamplingParams(temperature=0.0)
FAMILIES = ["tiny", "tiny-neox", "tiny-recursive", "tiny-block", "tiny-double"]


def tiny(name: str = "tiny"):
    torch.manual_seed(0)
    return build_model(from_name(name)).double().eval()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny(request.param)


def random_prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 258, (n,), generator=g).tolist() for n in lengths]


def naive_greedy(model, prompt, n):
    """Re-run the full forward for every token: no cache, no batch."""
    idx = torch.tensor([prompt])
    for _ in range(n):
        logits, _ = model(idx)
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return idx[0, len(prompt):].tolist()


def test_greedy_engine_equals_reference_with_mid_batch_joins_and_staggered_finishes(model):
    prompts = random_prompts((3, 11, 7, 5, 9, 2))
    budgets = [9, 5, 12, 6, 3, 7]
    reference = [generate(model, [p], n, temperature=0)[0] for p, n in zip(prompts, budgets)]
    engine = Engine(model, 2, sync_every=3)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts[:3], budgets[:3])]
    engine.step()  # two requests decode; the third waits for a slot
    assert [r.status for r in requests] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING]
    requests += [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts[3:], budgets[3:])]  # join mid-batch
    engine.run()
    assert [r.output for r in requests] == reference
    assert all(r.finished and r.finish_reason == "length" for r in requests)
    assert sorted(engine.scheduler.free) == [0, 1]


def test_admission_takes_the_longest_run_that_fits_with_a_few_checks_and_the_lowest_free_slots():
    """Thousands of waiting requests are admitted with a few room checks (one per request, over the group so far,
    took 12 s of host time for 4096), the same requests a check per request lets in: the longest run from the head
    of the queue that fits, the next one first in line; slots go lowest first, freed ones back the same way."""
    from blockloop.serve.requests import Request
    from blockloop.serve.scheduler import Scheduler

    scheduler = Scheduler(4000)
    lengths = [1 + i % 7 for i in range(3000)]
    for length in lengths:
        scheduler.add(Request([0] * length, 1, GREEDY))
    budget, checks = 6000, []

    def fits(group):
        checks.append(len(group))
        return sum(len(r.prompt) for r in group) <= budget

    admitted = scheduler.admit(fits)
    expected = max(k for k in range(len(lengths) + 1) if sum(lengths[:k]) <= budget)
    assert 0 < expected < len(lengths) and len(admitted) == expected and len(checks) <= 14
    assert [slot for slot, _ in admitted] == list(range(expected))
    assert scheduler.waiting[0] is not admitted[-1][1] and len(scheduler.waiting) == len(lengths) - expected
    assert all(r.status is RequestStatus.RUNNING for _, r in admitted)
    for slot in (7, 3, 900):
        scheduler.release(slot)
    assert [slot for slot, _ in scheduler.admit(lambda group: True)][:4] == [3, 7, 900, expected]


def test_requests_admitted_together_are_prefilled_together(model):
    """A runner with chunked prefill caches every admitted prompt in one forward whatever their lengths; the
    others group consecutive slots with one padded prompt length."""
    prompts = random_prompts((6, 6, 6, 9, 6), seed=4)
    reference = [generate(model, [p], 5, temperature=0)[0] for p in prompts]
    engine = Engine(model, 5, sync_every=2)
    chunked = engine.runner.chunked_prefill
    name = "prefill_chunk" if chunked else "prefill_rows"
    groups, shapes = [], []
    original = getattr(engine.runner, name)
    setattr(engine.runner, name, lambda start, p, *rest: groups.append((start, len(p))) or original(start, p, *rest))
    hooks = [module.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)) if args else None)
             for module in (model, getattr(model, "block_decoder", None)) if module is not None]
    try:
        requests = [engine.submit(p, 5, sampling=GREEDY) for p in prompts]
        engine.run()
    finally:
        for hook in hooks:
            hook.remove()
    assert [r.output for r in requests] == reference
    assert chunked == (model.config.family in ("decoder", "recursive"))
    assert groups == ([(0, 5)] if chunked else [(0, 3), (3, 1), (4, 1)])
    if model.config.family == "decoder":
        assert (5, 9) in shapes  # the five prompts in one forward, left-padded to the longest
    if model.config.family == "block":  # the first three prompts' blocks in one block-decoder forward
        assert (3, -(-6 // model.config.block_len), model.config.block_d_model) in shapes


@pytest.mark.parametrize("name,paging", [
    ("tiny-block", None), ("tiny-block", Paging(64, 4)), ("tiny-staircase", None), ("tiny-cached-staircase", None),
    ("tiny-encdec", None), ("tiny-encdec", Paging(256, 16)), ("tiny-double", None),
])
def test_a_group_admitted_together_is_prefilled_in_one_call_and_decodes_as_alone(name, paging):
    """The runners without chunked prefill take a window's group of same-length prompts in one ``prefill_rows``
    forward, never one ``prefill_slot`` each (the Block Transformer's first token took 31x vanilla's on the H200,
    with 256 one-row prefills the likely cause); each row then decodes what the prompt alone decodes."""
    model = tiny(name)
    prompts = random_prompts((8, 8, 8), seed=3)
    alone = [generate(model, [p], 6, temperature=0)[0] for p in prompts]
    engine = Engine(runner_for(model, paging=paging), 3, sync_every=2)
    engine.runner.prefill_slot = lambda *args: pytest.fail("a group was prefilled one slot at a time")
    requests = [engine.submit(p, 6, sampling=GREEDY) for p in prompts]
    engine.run()
    assert [r.output for r in requests] == alone


@pytest.mark.parametrize("name", ["tiny", "tiny-recursive", "tiny-ladder"])
def test_chunked_prefill_interleaves_long_prompts_with_decoding_and_equals_generate(name):
    """Prompts longer than the chunk are cached a chunk per window while the other rows decode; rows join
    mid-stream; every output equals greedy decoding by the uncached forward."""
    model = tiny(name)
    prompts = random_prompts((23, 3, 17, 5, 30, 2), seed=7)
    reference = [naive_greedy(model, p, 6) for p in prompts]
    engine = Engine(model, 3, sync_every=2, prefill_chunk=4)
    widths = []
    original = engine.runner.prefill_chunk
    engine.runner.prefill_chunk = lambda start, chunks, *rest: widths.append(chunks.shape[1]) or original(start, chunks, *rest)
    requests = [engine.submit(p, 6, sampling=GREEDY) for p in prompts]
    decoding_while_prefilling = False
    while not engine.idle:
        engine.step()
        decoding_while_prefilling |= bool(engine.prefilling) and any(r.output for r in engine.scheduler.running.values())
    assert [r.output for r in requests] == reference
    assert max(widths) == 4 and decoding_while_prefilling


def test_decoder_engine_equals_uncached_full_forward():
    model = tiny()
    prompts = random_prompts((4, 13, 1))
    engine = Engine(model, 3, sync_every=5)
    requests = [engine.submit(p, 8, sampling=GREEDY) for p in prompts]
    engine.run()
    assert [r.output for r in requests] == [naive_greedy(model, p, 8) for p in prompts]


def test_stopping_at_eos_frees_the_slot_for_the_next_request():
    model = tiny()
    free = generate(model, [[5, 6, 7]], 12, temperature=0)[0]
    eos = free[3]
    engine = Engine(model, 1, sync_every=2)
    first = engine.submit([5, 6, 7], 12, sampling=GREEDY, eos_id=eos)
    second = engine.submit([9, 10], 6, sampling=GREEDY)
    engine.run()
    assert first.output == free[: free.index(eos)] and first.finish_reason == "eos"
    assert first.slot == second.slot == 0  # the slot was reused after the first request finished
    assert second.output == naive_greedy(model, [9, 10], 6)  # nothing of the first request leaked


def test_per_request_sampling_is_seeded_and_independent_of_the_batch(model):
    prompt = [4, 5, 6]
    hot = SamplingParams(temperature=1.0, seed=7)

    def served(params_list, slots):
        engine = Engine(model, slots, sync_every=4)
        requests = [engine.submit(prompt if i == 0 else [9, 9], 10, sampling=s) for i, s in enumerate(params_list)]
        engine.run()
        return [r.output for r in requests]

    alone = served([hot], 1)[0]
    crowded = served([hot, SamplingParams(temperature=0.5, seed=1), GREEDY], 3)[0]
    assert alone == crowded  # the batch a request shares does not change its samples
    assert served([SamplingParams(temperature=1.0, seed=8)], 1)[0] != alone
    assert served([SamplingParams(temperature=1.0, top_k=1, seed=3)], 1)[0] == served([GREEDY], 1)[0]


def test_sample_rows_matches_the_distribution_and_its_filters():
    n = 4000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(n, 1)
    ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.long)
    seeds = torch.arange(n)

    def draw(top_k=0, top_p=1.0, temperature=1.0):
        return sample_rows(logits, ones * temperature, zeros + top_k, ones * top_p, seeds, zeros)

    assert abs((draw() == 0).float().mean().item() - 0.5) < 0.04
    assert set(draw().tolist()) == {0, 1, 2, 3}
    assert set(draw(top_k=2).tolist()) == {0, 1}
    assert set(draw(top_p=0.7).tolist()) == {0, 1}
    assert set(draw(top_p=0.4).tolist()) == {0}
    # top-p applies to what top-k kept, renormalised (0.625, 0.375), as in HF and vLLM: 0.625 alone reaches 0.6
    assert set(draw(top_k=2, top_p=0.6).tolist()) == {0}
    assert set(draw(temperature=0.0).tolist()) == {0}
    again = sample_rows(logits, ones, zeros, ones, seeds, zeros + 1)
    assert not torch.equal(again, draw())  # the per-row counter advances the stream


def test_a_request_without_top_p_keeps_every_token_when_a_batch_mate_filters():
    """top_p = 1 is "off": a request's distribution must not lose its tail because another request in the batch
    uses top-k (the engine then filters every row); float32 cumulative sums reach 1.0 before the tail ends."""
    torch.manual_seed(0)
    logits = (torch.randn(2, 32000) * 8)[:, None]  # peaked, over a large vocabulary
    sampling = SlotSampling.empty(2, torch.device("cpu"))
    sampling.set(0, SamplingParams(temperature=1.0, seed=1))
    sampling.set(1, SamplingParams(temperature=1.0, top_k=40, seed=2))
    sampling.filtered = True  # what the engine sets for this batch
    together = sampling.probs(logits)[0, 0]
    sampling.filtered = False  # the request alone
    alone = sampling.probs(logits)[0, 0]
    assert (together > 0).all() and torch.equal(together, alone)


def test_top_k_one_and_a_tiny_top_p_pick_the_greedy_token_among_ties():
    """bf16 logits tie often; the one token top_k=1 (or a tiny top_p) keeps must be argmax's, as greedy picks."""
    torch.manual_seed(0)
    n = 2000
    logits = (torch.randn(n, 4096) * 3).bfloat16()
    top = logits.max(-1, keepdim=True).values
    assert ((logits == top).sum(-1) > 1).any()  # some rows tie at the top
    ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.long)
    greedy = logits.argmax(-1)
    assert torch.equal(sample_rows(logits, ones, zeros + 1, ones, torch.arange(n), zeros), greedy)
    assert torch.equal(sample_rows(logits, ones, zeros, ones * 1e-6, torch.arange(n), zeros), greedy)


def test_streaming_callback_and_iterator_see_every_token_in_order():
    model = tiny()
    seen: dict[int, list[int]] = {}
    engine = Engine(model, 2, sync_every=3)
    requests = [engine.submit(p, 7, sampling=SamplingParams(temperature=0.8, seed=i),
                              on_token=lambda r, t: seen.setdefault(r.id, []).append(t))
                for i, p in enumerate(random_prompts((3, 6, 2)))]
    streamed: dict[int, list[int]] = {}
    for request, tokens in engine.stream():
        streamed.setdefault(request.id, []).extend(tokens)
    assert all(seen[r.id] == streamed[r.id] == r.output and len(r.output) == 7 for r in requests)


def test_a_token_callback_may_cancel_its_own_request_or_another(model):
    """A library user's callback stopping generation on its own rule: the cancel used to free the slot, then the
    window's end freed it again and the engine died (ValueError). Now the cancelled request takes no more tokens,
    every slot frees once, and the others (and a request admitted after) are exact."""
    prompts = random_prompts((3, 6, 2, 4))
    reference = [generate(model, [p], 9, temperature=0)[0] for p in prompts]
    engine = Engine(model, 3, sync_every=4)
    requests: list = []

    def stop_rules(request, token):
        if request is requests[0] and len(request.output) == 2:
            engine.cancel(request)  # itself, mid-window
        if request is requests[1] and len(request.output) == 1:
            engine.cancel(requests[2])  # another running request
    requests += [engine.submit(p, 9, sampling=GREEDY, on_token=stop_rules) for p in prompts]
    engine.run()
    assert [r.finish_reason for r in requests] == ["abort", "length", "abort", "length"]
    assert requests[0].output == reference[0][:2]
    assert requests[1].output == reference[1] and requests[3].output == reference[3]
    assert requests[2].output == reference[2][: len(requests[2].output)]
    assert engine.idle and sorted(engine.scheduler.free) == [0, 1, 2]


def test_a_callback_that_raises_ends_its_own_request_and_costs_the_others_no_token():
    """An error in one request's callback (or a Ctrl-C while it prints) left the rest of the window unhanded: the
    other requests lost tokens their caches held. Now the error is raised after every other request took its
    tokens; the failing request ends (abort), and the engine goes on exactly."""
    model = tiny()
    prompts = random_prompts((3, 5))
    reference = generate(model, [prompts[1]], 8, temperature=0)[0]
    engine = Engine(model, 2, sync_every=4)

    def fails(request, token):
        if len(request.output) == 2:
            raise RuntimeError("the callback's own bug")
    first = engine.submit(prompts[0], 8, sampling=GREEDY, on_token=fails)
    second = engine.submit(prompts[1], 8, sampling=GREEDY)
    with pytest.raises(RuntimeError, match="the callback's own bug"):
        engine.run()
    assert first.finish_reason == "abort" and len(first.output) == 2
    engine.run()
    assert second.output == reference and engine.idle and sorted(engine.scheduler.free) == [0, 1]


def test_cache_writes_each_row_at_its_own_slots_and_row_views_write_through():
    cache = DecoderCache(1, 3, 1, 6, 2, dtype=torch.float32, device="cpu")
    slots = torch.tensor([[0], [4], [2]])
    k = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 1, 2)
    keys, _ = cache.layers[0].write(slots, k, k)
    cache.mark(slots)
    mask = cache.mask(slots)
    for row, slot in enumerate([0, 4, 2]):
        assert torch.equal(keys[row, 0, slot], torch.full((2,), float(row)))
        assert keys[row, 0].abs().sum() == 2 * row  # nothing else of the row was written
        assert cache.key_valid[row].tolist() == [s == slot for s in range(6)]
        # an eager CPU step's mask covers the slots up to its furthest query's only: 4 here
        assert mask[row, 0, 0].tolist() == [s == slot for s in range(5)]
    view = cache.rows(1, 2)
    view.reset()
    view.layers[0].write(torch.tensor([1]), torch.full((1, 1, 1, 2), 9.0), torch.zeros(1, 1, 1, 2))
    view.mark(torch.tensor([1]))
    assert cache.layers[0].k[1, 0, 1].tolist() == [9.0, 9.0]
    assert cache.key_valid[1].tolist() == [False, True, False, False, False, False]
    assert cache.key_valid[2, 2]  # other rows untouched


def test_building_a_mask_does_not_change_the_cache():
    cache = DecoderCache(1, 2, 1, 5, 2, dtype=torch.float32, device="cpu")
    cache.mark(torch.tensor([[0, 1], [0, 1]]), torch.tensor([[False, True], [True, True]]))
    before = cache.key_valid.clone()
    mask = cache.mask(torch.tensor([[2], [3]]))
    assert torch.equal(cache.key_valid, before)  # the queries' own slots were not marked
    assert mask[0, 0, 0].tolist() == [False, True, True, False]  # itself always, padding never
    assert mask[1, 0, 0].tolist() == [True, True, False, True]  # no slot past the furthest query's


def test_every_model_family_has_a_runner():
    from blockloop.families import FAMILIES
    from blockloop.serve.runners import RUNNERS, Runner

    assert set(RUNNERS) == set(FAMILIES)
    for family in ("decoder", "block", "double_decoder", "encoder_decoder", "staircase", "ladder", "recursive"):
        assert isinstance(runner_for(tiny(PRESET_OF[family])), Runner)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_registered_preset_runs_a_forward_and_a_cached_decode_through_its_runner(name):
    """Every preset at test size: its runner serves three requests on two slots (the third joins while the second
    is still decoding), and each request's greedy tokens are those of the uncached full forward over its prompt as
    the engine fed it (left-padded to the runner's prompt multiple)."""
    torch.manual_seed(0)
    model = build_model(small_variant(name)).eval()
    runner = runner_for(model)
    prompts = [[int(t) for t in torch.randint(1, 64, (n,))] for n in (8, 5, 6)]
    engine = Engine(runner, 2, max_len=min(model.config.context_length, 32), sync_every=2)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, (2, 4, 3))]
    engine.run()
    for prompt, request in zip(prompts, requests):
        fed = [runner.pad_id] * (-len(prompt) % runner.prompt_multiple) + prompt
        assert request.output == full_forward_greedy(model, fed, request.max_tokens), name


PRESET_OF = {"decoder": "tiny", "block": "tiny-block", "double_decoder": "tiny-double", "encoder_decoder": "tiny-encdec",
             "staircase": "tiny-staircase", "ladder": "tiny-ladder", "recursive": "tiny-recursive"}


def full_forward_greedy(model, prompt, n):
    """Greedy tokens from the family's uncached full forward, re-run for every token (no runner at all)."""
    out = []
    for _ in range(n):
        seq = prompt + out
        family = model.config.family
        if family == "encoder_decoder":
            logits, _ = model(torch.tensor([seq[: len(prompt) - 1]], dtype=torch.long), decoder_idx=torch.tensor([seq[len(prompt) - 1 :]]))
        elif family == "double_decoder":
            boundaries = torch.tensor([0, len(prompt) - 1, len(seq)]) if len(prompt) > 1 else None
            logits, _ = model(torch.tensor([seq]), boundaries=boundaries)
        else:  # whole blocks / chunks: tokens after the one predicted cannot change its logits (causality)
            unit = spec_of(model.config).sequence_multiple(model.config)
            aligned = family == "block"  # a Block Transformer's logits at position t predict token t itself
            logits, _ = model(torch.tensor([seq + [0] * (-(len(seq) + aligned) % unit + aligned)]))
            logits = logits[:, : len(seq) + aligned]
        out.append(int(logits[0, -1, : model.config.vocab_size].argmax()))  # generation never samples padding ids
    return out


@pytest.mark.parametrize("name", ["tiny-recursive", "tiny-double", "tiny-encdec"])  # ladder, staircase: test_staircase_engine
def test_every_family_serves_a_continuous_batch_with_joins_like_its_full_forward(name):
    model = tiny(name)
    prompts, budgets = random_prompts((3, 9, 6, 1)), [6, 4, 7, 5]  # a one-token prompt leaves the encoder nothing
    engine = Engine(model, 2, sync_every=2)
    assert engine.continuous
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts[:3], budgets[:3])]
    engine.step()
    requests.append(engine.submit(prompts[3], budgets[3], sampling=GREEDY))  # joins mid-batch
    engine.run()
    assert [r.output for r in requests] == [full_forward_greedy(model, p, n) for p, n in zip(prompts, budgets)]


DEPTHWISE = {"exit_rule": ExitRule("max_prob", 0.012)}  # some tokens leave after loop 1, some run both


@pytest.mark.parametrize("name,options", [
    ("tiny", {}), ("tiny", {"paging": Paging(256, page_size=8)}), ("tiny-recursive", {}), ("tiny-ladder", {}),
    ("tiny-recursive", DEPTHWISE), ("tiny-recursive", {**DEPTHWISE, "loop_read": "blocks"}),
    ("tiny-recursive", {**DEPTHWISE, "paging": Paging(512, page_size=8)}),
    ("tiny-recursive", {"speculation": Speculation(k=2)}), ("tiny-recursive", {"speculation": Speculation(k=3, adaptive=True)}),
    ("tiny-double", {}), ("tiny-block", {}), ("tiny-staircase", {}), ("tiny-cached-staircase", {}),
    ("tiny-global-staircase", {}), ("tiny-feedback", {}), ("tiny-block", {"paging": Paging(256, page_size=2)}), ("tiny-encdec", {}),
    ("tiny-encdec", {"paging": Paging(256, page_size=8)})])
def test_a_lightly_loaded_engine_steps_only_its_busy_prefix_of_slots(name, options):
    """Three requests on eight slots step four rows; once only slot 0 is busy, one row; two requests joining
    then take slots 1 and 2 (rows the narrow steps left alone) and widen it again. Every output is the one a
    1-slot engine (never an idle row) gives: ``generate``'s, or, for depth-wise batching with early exit (whose
    tokens are not the full model's), a 1-slot engine's over the same kind of runner."""
    assert row_buckets(8) == [1, 2, 4, 8] and row_buckets(6) == [1, 2, 4, 6]
    assert row_buckets(1000)[-1] == 1000 and len(row_buckets(1000)) == 8
    model = tiny(name)
    runner = runner_for(model, **options)
    assert runner.prefix_steps
    widths, step = [], runner.decode_step
    runner.decode_step = lambda tokens: widths.append(len(tokens)) or step(tokens)
    engine = Engine(runner, 8, sync_every=2)
    prompts, budgets = random_prompts((5, 3, 8, 4, 6)), [30, 2, 3, 4, 5]
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts[:3], budgets[:3])]
    while widths[-1:] != [1]:
        engine.step()
    assert widths[0] == 4 and not requests[0].finished
    requests += [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts[3:], budgets[3:])]
    engine.run()
    assert [r.slot for r in requests[3:]] == [1, 2]
    assert widths[-1] == 1 and 4 in widths[widths.index(1):] and set(widths) == {1, 4}
    if "exit_rule" not in options:
        assert [r.output for r in requests] == [generate(model, [p], n, temperature=0)[0] for p, n in zip(prompts, budgets)]
        return
    alone = Engine(runner_for(model, **options), 1, sync_every=2)
    reference = [alone.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
    alone.run()
    assert [r.output for r in requests] == [r.output for r in reference]
    assert 1.0 < runner.mean_exit_loop() < 2.0


@pytest.mark.parametrize("options", [{}, {"paging": Paging(64, 4)}, {"exit_rule": ExitRule("none")}])
def test_rows_that_keep_stepping_past_the_context_stay_inside_a_learned_position_table(options):
    """A finished or idle row of a continuous batch keeps stepping while another request runs; its position used
    to grow past the context and index past a learned (GPT-2 style) position table."""
    torch.manual_seed(0)
    name = "tiny-recursive" if "exit_rule" in options else "tiny"
    model = build_model(from_name(name, learned_positions=True, context_length=32)).double().eval()
    greedy = SamplingParams(temperature=0.0)
    work = [(list(range(1, 32)), 1), ([5], 31)]  # 31 + 1 and 1 + 31: each fills the context exactly
    alone = []
    for prompt, n in work:
        engine = Engine(runner_for(model, **options), 1, sync_every=4)
        alone.append(engine.submit(prompt, n, sampling=greedy))
        engine.run()
    engine = Engine(runner_for(model, **options), 2, sync_every=4)
    together = [engine.submit(prompt, n, sampling=greedy) for prompt, n in work]
    engine.run()
    assert [r.output for r in together] == [r.output for r in alone]


def test_on_cpu_each_window_is_one_step_so_tokens_stream_one_at_a_time():
    """On CPU reading the tokens costs nothing, so the default window is one step: after each ``step`` every
    running request has one more token (a window of 8 would hand over 8 at once)."""
    engine = Engine(tiny(), 2)
    assert engine.sync_every == 1 and default_sync_every(torch.device("cuda")) == 8
    requests = [engine.submit(p, 6, sampling=GREEDY) for p in random_prompts((4, 7))]
    for count in range(1, 7):
        engine.step()
        assert [len(r.output) for r in requests] == [count, count]
    assert engine.idle


def test_a_request_ending_at_eos_frees_its_slot_without_stepping_past_it():
    """A request that reaches EOS after ``k`` tokens costs ``k + 1`` one-step windows on CPU (the last samples
    the EOS), not a window of 8."""
    model, prompt = tiny(), random_prompts((5,))[0]
    seeded = SamplingParams(temperature=1.0, seed=3)  # the same tokens on every run; greedy repeats one token here
    unstopped = Engine(model, 1)
    free = unstopped.submit(prompt, 12, sampling=seeded)
    unstopped.run()
    k = next(k for k in range(2, 12) if free.output[k] not in free.output[:k])  # its first new token: the EOS
    assert k < 7, "the EOS must come before a window of 8 ends"
    engine = Engine(model, 1)
    stopped = engine.submit(prompt, 12, sampling=seeded, eos_id=free.output[k])
    engine.run()
    assert stopped.finish_reason == "eos" and stopped.output == free.output[:k]
    assert engine.steps == k + 1 and Engine(model, 1, sync_every=8).sync_every == 8


def test_block_transformer_admits_requests_only_at_block_boundaries():
    model = tiny("tiny-block")
    engine = Engine(model, 2, sync_every=3)
    assert engine.sync_every == 4  # rounded up to the block length
    with pytest.raises(RuntimeError, match="block boundaries"):
        engine.runner.phase = 1
        engine.runner.prefill_slot(0, torch.ones(4, dtype=torch.long))


def test_bad_requests_and_engines_are_clear_errors():
    model = tiny()
    with pytest.raises(BlockloopError, match="slots, at least one"):
        Engine(model, 0)
    engine = Engine(model, 1)
    with pytest.raises(BlockloopError, match="exceeds the engine's 128-token slots"):
        engine.submit([1] * 120, 10)
    with pytest.raises(BlockloopError, match="non-empty"):
        engine.submit([], 10)
    with pytest.raises(BlockloopError, match="max_tokens"):
        engine.submit([1], 0)
    with pytest.raises(BlockloopError, match="token ids"):
        engine.submit([100000], 2)
    with pytest.raises(BlockloopError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(BlockloopError, match="temperature"):
        SamplingParams(temperature=-1)
    # wrong types and values a tensor cannot hold are the same one-line errors, not TypeError / OverflowError
    for bad_prompt in ("abc", None, [[1, 2]], [1.7, 2.2], torch.ones(2, 2, dtype=torch.long)):
        with pytest.raises(BlockloopError, match="integer token ids"):
            engine.submit(bad_prompt, 2)
    assert engine.submit(torch.tensor([1, 2]), 2).prompt == [1, 2]  # a 1-D tensor of ids is a prompt
    for bad_budget in (2.5, None, "3"):
        with pytest.raises(BlockloopError, match="max_tokens"):
            engine.submit([1], bad_budget)
    with pytest.raises(BlockloopError, match="slots"):
        Engine(model, 1.5)
    for bad in ({"sync_every": 1.5}, {"prefill_chunk": 2.5}, {"max_len": 8.5}):  # a raw TypeError, or kept silently
        with pytest.raises(BlockloopError, match=next(iter(bad))):
            Engine(model, 1, **bad)
    with pytest.raises(BlockloopError, match="sampling is a SamplingParams, got dict"):
        engine.submit([1], 2, sampling={"temperature": 0})
    # the engine serves in eval mode and says so: no moment to restore a training model's mode
    model.train()
    Engine(model, 1)
    assert not model.training and "left so" in Engine.__doc__
    # generate takes any integer seed, however large (it overflowed int64 from 2**47), and it still replays
    assert generate(model, [[1, 2]], 3, seed=2**70) == generate(model, [[1, 2]], 3, seed=2**70)
    for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_k": 2.5}, {"top_k": 2**64},
                {"seed": 2**70}, {"seed": 1.5}):
        with pytest.raises(BlockloopError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_serving_metrics_on_synthetic_timestamps():
    timings = [Timing(0.0, [1.0, 1.5, 2.0, 3.0]), Timing(1.0, [1.5, 3.5]), Timing(2.0, [4.0])]
    m = serving_metrics(timings)
    assert m["output_tokens"] == 7 and m["duration_s"] == 4.0 and m["throughput_tok_s"] == 7 / 4
    assert m["ttft_s"]["mean"] == pytest.approx((1.0 + 0.5 + 2.0) / 3)
    assert m["ttft_s"]["median"] == 1.0
    assert m["tpot_s"]["mean"] == pytest.approx((2.0 / 3 + 2.0) / 2)  # the 1-token request has no TPOT
    # ITL pools the gaps 0.5, 0.5, 1.0 (request 0) and 2.0 (request 1)
    assert m["itl_s"]["median"] == pytest.approx(0.75) and m["itl_s"]["mean"] == pytest.approx(1.0)
    assert m["e2e_s"]["p90"] == pytest.approx(2.9)  # rank 0.9 * 2 = 1.8 in [2.0, 2.5, 3.0]
    assert summarize([1.0] * 99 + [101.0])["p99"] == pytest.approx(2.0)
    with pytest.raises(BlockloopError, match="no finished requests"):
        serving_metrics([])
    assert pareto_front([(1.0, 3.0), (2.0, 2.5), (3.0, 2.8), (0.5, 3.5)]) == [(2.0, 2.5), (3.0, 2.8)]


def test_bench_cli_runs_throughput_and_stream_end_to_end(tmp_path, capsys):
    record = tmp_path / "bench.jsonl"
    common = ["--device", "cpu", "--record", str(record)]
    assert main(["bench", "--presets", "tiny,tiny-block", "--prompt-len", "8", "--gen-len", "8",
                 "--batch-sizes", "1,2", "--repeats", "1", "--warmup", "0", *common]) == 0
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(r["name"], r["batch"]) for r in rows] == [("tiny", 1), ("tiny", 2), ("tiny-block", 1), ("tiny-block", 2)]
    assert all(r["tok_s"] > 0 and 0 < r["roofline_fraction"] for r in rows)
    assert rows[0]["ratio_vs_baseline"] == 1.0 and rows[0]["device"].startswith("cpu")
    capsys.readouterr()
    # A one-token answer has no time per output token after the first: none is printed or recorded.
    assert main(["bench", "--presets", "tiny", "--prompt-len", "8", "--gen-len", "1", "--batch-sizes", "1",
                 "--repeats", "1", *common]) == 0
    assert json.loads(record.read_text().splitlines()[-1])["tpot_s"] is None
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny | 1 |")]
    assert row.split(" | ")[5] == "-", row  # the TPOT column
    assert main(["bench", "--stream", "--presets", "tiny-recursive", "--requests", "5", "--slots", "2",
                 "--prompt-range", "4,9", "--tokens-range", "2,6", "--exit", "none:0", *common]) == 0
    sequence_wise, depth_wise = map(json.loads, record.read_text().splitlines()[-2:])
    assert sequence_wise["requests"] == 5 and 10 <= sequence_wise["output_tokens"] <= 30
    assert depth_wise["output_tokens"] == sequence_wise["output_tokens"]
    assert depth_wise["agreement_vs_no_exit"] == 1.0 and depth_wise["mean_exit_loop"] == 2.0
    # flags left to their defaults are recorded with what they resolved to, not "auto" and null
    assert {k: sequence_wise["settings"][k] for k in ("device", "dtype", "sync_every")} == {
        "device": "cpu", "dtype": sequence_wise["dtype"], "sync_every": 1} and sequence_wise["dtype"] != "auto"
    out = capsys.readouterr().out
    assert "| tiny-recursive depth-wise exit none:0 | 2 |" in out
    # The stream runs the engine as `serve` does (on CPU every step reaches the host), so short requests get a TPOT.
    assert sequence_wise["sync_every"] == 1 and sequence_wise["tpot_s"]["median"] > 0 and "(--sync-every)" not in out
    assert main(["bench", "--stream", "--presets", "tiny", "--requests", "3", "--slots", "2", "--prompt-range", "4,9",
                 "--tokens-range", "2,6", "--sync-every", "8", *common]) == 0
    assert json.loads(record.read_text().splitlines()[-1])["sync_every"] == 8
    assert "tokens reach the host every 8 steps (--sync-every)" in capsys.readouterr().out
    # A Block Transformer's window is its block length (4) even at --sync-every 1: the note says no lower one helps.
    assert main(["bench", "--stream", "--presets", "tiny-block", "--requests", "3", "--slots", "2", "--prompt-range",
                 "4,8", "--tokens-range", "2,6", "--sync-every", "1", *common]) == 0
    block = json.loads(record.read_text().splitlines()[-1])
    assert (block["sync_every"], block["admit_every"]) == (4, 4)
    assert block["settings"]["prompt_range"] == [4, 8] and block["settings"]["requests"] == 3  # how it was measured
    assert "block length (4), so --sync-every cannot lower it" in capsys.readouterr().out


def test_bench_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["bench", "--presets", "tiny", "--device", "cpu", "--prompt-len", "200"]) == 2  # 200 + 1 > 128
    assert "does not fit a model context of 128 tokens with --prompt-len 200" in capsys.readouterr().err
    assert main(["bench", "--presets", "tiny", "--device", "cpu", "--prompt-len", "100", "--gen-len", "100"]) == 2
    assert "prompt 100 + generation 100, a slot of 200 tokens exceeds the model context of 128" in capsys.readouterr().err
    assert main(["bench", "--presets", "tiny", "--batch-sizes", "0", "--prompt-len", "4", "--gen-len", "4"]) == 2
    assert "--batch-sizes: needs positive integers" in capsys.readouterr().err
    assert main(["bench", "--plot", str(tmp_path / "a.png"), "--record", str(tmp_path / "none.jsonl")]) == 2
    assert "no benchmark records" in capsys.readouterr().err


def test_pareto_plot_from_records(tmp_path):
    pytest.importorskip("matplotlib")
    record = tmp_path / "r.jsonl"
    rows = [{"kind": "throughput", "name": n, "prompt_len": 8, "gen_len": 8, "tok_s": t, "val_loss": v}
            for n, t, v in [("a", 10.0, 3.0), ("b", 40.0, 3.2)]]
    record.write_text("\n".join(map(json.dumps, rows)))
    assert main(["bench", "--plot", str(tmp_path / "p.png"), "--record", str(record)]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0
    for out in (tmp_path / "p.xyz", tmp_path / "p", tmp_path):  # matplotlib would refuse, or write p.png
        assert main(["bench", "--plot", str(out), "--record", str(record)]) == 2
    assert not (tmp_path / "p.xyz").exists() and not (tmp_path / "p.png.png").exists()
    edited = tmp_path / "edited.jsonl"  # a loss written as text by hand: one line, not a TypeError
    edited.write_text("\n".join(map(json.dumps, [*rows, {**rows[0], "name": "c", "val_loss": "NaN"}])))
    assert main(["bench", "--plot", str(tmp_path / "e.png"), "--record", str(edited)]) == 2
    for other in ({"dtype": "bfloat16"}, {"threads": 2}, {"prompt_len": 16}):  # a faster setup is not a faster model
        mixed = tmp_path / "mixed.jsonl"
        mixed.write_text("\n".join(map(json.dumps, [*rows, {**rows[0], "name": "c", **other}])))
        assert main(["bench", "--plot", str(tmp_path / "m.png"), "--record", str(mixed)]) == 2
        assert not (tmp_path / "m.png").exists()


def test_losses_that_score_different_things_are_not_plotted_on_one_axis(tmp_path, capsys):
    """An encoder-decoder's validation loss is span corruption's, a decoder's next-token: bench records what each
    run's loss scores, and the plot refuses to put them on one axis."""
    pytest.importorskip("matplotlib")
    from server_helpers import tiny_run

    runs = [str(tiny_run(tmp_path, preset)) for preset in ("tiny", "tiny-encdec")]
    record = tmp_path / "r.jsonl"
    assert main(["bench", "--checkpoint", runs[0], "--checkpoint", runs[1], "--batch-sizes", "1", "--prompt-len", "4",
                 "--gen-len", "4", "--repeats", "1", "--device", "cpu", "--record", str(record)]) == 0
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["val_loss_measure"] for r in rows] == ["next token, byte tokens", "span corruption, byte tokens"]
    assert all(r["val_loss"] is not None for r in rows)
    capsys.readouterr()
    assert main(["bench", "--plot", str(tmp_path / "p.png"), "--record", str(record)]) == 2
    assert "validation losses score different things (next token, byte tokens; span corruption" in capsys.readouterr().err
    record.write_text(json.dumps(rows[0]) + "\n")
    assert main(["bench", "--plot", str(tmp_path / "p.png"), "--record", str(record)]) == 0


@pytest.mark.parametrize("name,options", [
    ("tiny", {}), ("tiny-block", {}), ("tiny-recursive", {"exit_rule": ExitRule("max_prob", 0.5)}),
    ("tiny-recursive", {"speculation": Speculation(k=2)}),
])
def test_no_output_of_a_decode_step_is_alive_when_the_next_one_runs(name, options):
    """cudagraph trees replay the graph captured first only when no output of the last replay is alive (else they
    capture one more graph per step of a window, in a timed run too); the engine must have let go of a step's logits,
    readiness and emitted tokens by the time it calls the next. The step here returns copies only the engine holds."""
    import weakref

    runner = runner_for(tiny(name), **options)
    step, outputs, alive = runner.decode_step, [], []

    def step_of_copies(tokens):
        alive.append(sum(ref() is not None for ref in outputs))
        out = step(tokens)
        tensors = [out] if isinstance(out, torch.Tensor) else [t for t in out if t is not None]
        copies = [t.clone() for t in tensors]
        outputs[:] = [weakref.ref(t) for t in copies]
        return copies[0] if isinstance(out, torch.Tensor) else type(out)(*copies, *[None] * (len(out) - len(copies)))

    runner.decode_step = step_of_copies
    engine = Engine(runner, 2, sync_every=4)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(random_prompts((5, 9)), (12, 7))]
    engine.run()
    assert all(r.finished for r in requests) and len(alive) >= 4 and not any(alive)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,options", [
    ("tiny", {}), ("tiny-block", {}), ("tiny-double", {}), ("tiny-encdec", {}), ("tiny-staircase", {}),
    ("tiny-cached-staircase", {}),
    ("tiny-recursive", {"exit_rule": ExitRule("max_prob", 0.5)}),
    ("tiny-recursive", {"speculation": Speculation(k=2, draft_loops=1)}),
])
def test_compiled_cuda_graph_decode_in_bf16_matches_eager(name, options):
    """Four slots and staggered requests, so prefix steps run at several row counts; every compiled step must
    replay as a CUDA graph (inductor counts a step that falls back to eager, e.g. for updating a plain tensor
    in place) and decode the tokens eager decoding does."""
    from torch._dynamo.utils import counters

    model = tiny(name).to(device="cuda", dtype=torch.bfloat16)
    prompts = random_prompts((5, 9, 3, 12, 7))
    outs = []
    counters.clear()
    for compile in (False, True):
        engine = Engine(runner_for(model, **options), 4, sync_every=8, compile=compile)
        requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, (40, 16, 12, 16, 8))]
        engine.run()
        outs.append([r.output for r in requests])
    torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0
    agree = sum(a == b for x, y in zip(*outs) for a, b in zip(x, y)) / sum(len(x) for x in outs[0])
    assert agree > 0.9  # bf16 kernels may differ in the last bit; near-ties can flip late tokens


def test_hf_generate_baseline_decodes_the_same_greedy_tokens():
    pytest.importorskip("transformers")
    from blockloop.bench.hf_baseline import hf_throughput
    from blockloop.convert.hf import to_hf_model

    model = tiny().float()
    prompts = random_prompts((6, 6))
    engine = Engine(model, 2)
    requests = [engine.submit(p, 8, sampling=GREEDY) for p in prompts]
    engine.run()
    hf = to_hf_model(model).eval()
    out = hf.generate(torch.tensor(prompts), attention_mask=torch.ones(2, 6, dtype=torch.long), max_new_tokens=8,
                      min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[:, 6:].tolist() == [r.output for r in requests]
    result = hf_throughput(model, 2, 6, 4, repeats=1, warmup=0)
    assert result.name == "hf-generate" and result.tok_s > 0


def test_a_short_warm_up_generates_warmup_tokens_and_the_timed_runs_the_whole_length(monkeypatch):
    """``warmup_tokens`` shortens only the untimed runs (the GPU suite's decode-heavy warm-up cost as much as its
    timed run); the timed runs and the TTFT runs ask for what they always did, for the engine and for HF."""
    from blockloop.bench import hf_baseline, throughput

    asked: list[int] = []
    submit = Engine.submit
    monkeypatch.setattr(Engine, "submit", lambda self, prompt, n, **kw: asked.append(n) or submit(self, prompt, n, **kw))
    result = throughput.engine_throughput(tiny().float(), "tiny", 2, 4, 9, repeats=1, warmup=2, warmup_tokens=3)
    assert asked == [3, 3, 1, 1] * 2 + [9, 9, 1, 1] and result.compile_s is None  # an eager engine compiles nothing
    if hf_baseline.hf_available() is None:
        lengths: list[int] = []
        monkeypatch.setattr(hf_baseline, "hf_generate", lambda hf, ids, n: lengths.append(n))
        hf_baseline.hf_throughput(tiny().float(), 2, 4, 9, repeats=2, warmup=1, warmup_tokens=3)
        assert lengths == [3, 9, 9]


def test_depthwise_batching_refuses_loops_that_do_not_share_layers_and_a_minimum_past_the_last_loop():
    model = build_model(from_name("tiny-recursive", tying="sequence", n_layer=2)).eval()
    with pytest.raises(BlockloopError, match="needs cycle tying .* not 'sequence'; drop --exit .* --strategy cycle"):
        runner_for(model, exit_rule=ExitRule("none"))
    with pytest.raises(BlockloopError, match="min_loops=3 is more loops than the model's 2"):
        runner_for(tiny("tiny-recursive"), exit_rule=ExitRule("max_prob", 0.9, min_loops=3))


def test_depthwise_batching_without_exits_equals_sequence_wise_greedy():
    model = tiny("tiny-recursive")
    prompts, budgets = random_prompts((3, 11, 7, 5, 9)), [9, 4, 7, 6, 2]
    reference = [generate(model, [p], n, temperature=0)[0] for p, n in zip(prompts, budgets)]
    served = runner_for(model, exit_rule=ExitRule("none"))
    engine = Engine(served, 2, sync_every=3)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
    engine.run()
    assert [r.output for r in requests] == reference
    assert served.mean_exit_loop() == 2.0  # every token ran both loops
    for budget in (1, 2, 5):  # windows must not stop on a token count: depth-wise rows emit at uneven steps
        engine.submit(prompts[0], budget, sampling=GREEDY)
        engine.run()
        assert engine.last_window[-1][0].output == reference[0][:budget]


def test_early_exit_skips_loops_and_fills_the_owed_deeper_kv():
    model = tiny("tiny-recursive")
    served = runner_for(model, exit_rule=ExitRule("max_prob", 0.0))  # every token may leave after loop 1
    engine = Engine(served, 1, sync_every=4)
    request = engine.submit([5, 6, 7], 6, sampling=GREEDY)
    engine.run()
    assert len(request.output) == 6 and served.mean_exit_loop() == 1.0
    cache = served.state.cache
    loop0, loop1 = cache.layers[0], cache.layers[1]  # depth entries 0 and 1: loops 0 and 1 of shared layer 0
    generated = slice(3, 3 + 5)  # the fed-back generated tokens exited after loop 0: loop 1 holds a copy
    for kv in ("k", "v"):
        first, second = getattr(loop0, kv)[0], getattr(loop1, kv)[0]
        assert torch.equal(second[:, generated], first[:, generated])
        assert not torch.equal(second[:, :3], first[:, :3])  # the prompt ran both loops
    k = cache.stacked[0][0]  # the loops lie one after the other along the key axis: the entries are views of it
    assert loop0.k.data_ptr() == k.data_ptr() and loop1.k.data_ptr() == k[:, :, cache.span :].data_ptr()


def test_exit_rules_on_known_distributions():
    logits = torch.log(torch.tensor([[0.9, 0.05, 0.05], [0.4, 0.3, 0.3]]))
    one = torch.ones(2, dtype=torch.long)
    assert ExitRule("max_prob", 0.8).fires(logits, one).tolist() == [True, False]
    entropy_first = -(0.9 * math.log(0.9) + 0.1 * math.log(0.05))
    assert ExitRule("entropy", entropy_first + 1e-4).fires(logits, one).tolist() == [True, False]
    assert ExitRule("max_prob", 0.8, min_loops=2).fires(logits, one).tolist() == [False, False]
    assert ExitRule("none").fires(logits, one).tolist() == [False, False]
    with pytest.raises(BlockloopError, match="unknown exit rule"):
        ExitRule("confidence")


def test_poisson_stream_serves_every_request_and_counts_queueing_in_ttft():
    from blockloop.bench.stream import run_stream, schedule

    metrics = run_stream(tiny(), random_prompts((4, 7, 5, 6)), n_slots=2, min_tokens=3, max_tokens=5, rate=200.0,
                         sync_every=2)
    assert metrics["requests"] == 4 and 12 <= metrics["output_tokens"] <= 20
    assert all(3 <= len(o) <= 5 for o in metrics["outputs"])
    assert metrics["ttft_s"]["median"] > 0 and metrics["e2e_s"]["p99"] >= metrics["ttft_s"]["p99"]
    # the load the arrivals offer: a server's throughput cannot pass it (near it, the rate was measured)
    offsets, budgets = schedule(4, 200.0, 3, 5)
    assert metrics["offered_tok_s"] == pytest.approx(budgets.sum() / offsets[-1])
    with pytest.raises(BlockloopError, match="--rate"):
        run_stream(tiny(), [[1, 2]], n_slots=1, min_tokens=1, max_tokens=1, rate=0.0)


def test_an_engine_told_not_to_step_busy_rows_alone_steps_every_slot_in_one_graph():
    """``busy_rows=False``: one compiled graph a server (a saturated GPU benchmark cannot pay one per row count),
    and the same tokens."""
    prompts, budgets = random_prompts((4, 7, 5)), [6, 3, 5]
    outputs = []
    for busy_rows in (True, False):
        engine = Engine(tiny(), 4, max_len=32, sync_every=2, busy_rows=busy_rows)
        assert engine.row_counts == ([1, 2, 4] if busy_rows else [4])
        requests = [engine.submit(p, n, sampling=SamplingParams(temperature=0.0)) for p, n in zip(prompts, budgets)]
        engine.run()
        outputs.append([r.output for r in requests])
    assert outputs[0] == outputs[1]


def test_a_stream_sizes_its_slots_to_its_longest_request_and_cuts_prompts_with_the_models_tokenizer(monkeypatch):
    from blockloop.bench import stream
    from blockloop.data.corpora import load_documents
    from blockloop.data.tokenizers import build_tokenizer

    lengths = []
    real_engine = stream.Engine

    def engine(*args, **kwargs):
        lengths.append(kwargs["max_len"])
        return real_engine(*args, **kwargs)

    monkeypatch.setattr(stream, "Engine", engine)
    stream.run_stream(tiny("tiny-block"), random_prompts((5, 9, 3)), n_slots=2, min_tokens=2, max_tokens=4)
    _, budgets = stream.schedule(3, float("inf"), 2, 4)
    padded = [8, 12, 4]  # the prompts padded to whole blocks of 4
    assert lengths == [max(p + b for p, b in zip(padded, budgets))]  # the longest request, prompt and budget
    tokenizer = build_tokenizer("smollm2")
    prompts = stream.corpus_prompts(tokenizer.vocab_size, 3, 8, 12, tokenizer=tokenizer)
    corpus = "\n".join(load_documents("shakespeare"))
    assert all(8 <= len(p) <= 12 and tokenizer.decode(p).strip() in corpus for p in prompts)
    assert max(max(p) for p in prompts) > 255  # real subword ids, not bytes


def test_the_paper_scenarios_are_shortened_to_fit_the_model_context():
    """2048 + 128 overruns the 2048-token context of the paper's own models by one block of 128."""
    from blockloop.bench.throughput import scenario_lengths

    vanilla = build_model(from_name("pythia-5m"))
    block = build_model(from_name("block-5m"))
    assert scenario_lengths("decode-heavy", [vanilla]) == (128, 1920)
    assert scenario_lengths("prefill-heavy", [vanilla, block]) == (1920, 128)
    tiny = build_model(from_name("tiny"))  # a context of 128: the paper's 128-token part cannot stay whole
    assert scenario_lengths("decode-heavy", [tiny]) == (7, 121)  # 128 x 128 / 2176 = 7.5
    assert scenario_lengths("prefill-heavy", [tiny, build_model(from_name("tiny-block"))]) == (120, 8)  # whole blocks
    # A given length is kept; only the paper's other one gives way (it used to refuse, or shorten the given one).
    assert scenario_lengths("decode-heavy", [tiny], prompt_len=8) == (8, 120)
    assert scenario_lengths("decode-heavy", [vanilla], gen_len=100) == (128, 100)
    assert scenario_lengths("prefill-heavy", [vanilla, block], gen_len=1000) == (1048, 1000)  # the context exactly
    assert scenario_lengths("decode-heavy", [tiny], prompt_len=100, gen_len=100) == (100, 100)  # check_lengths refuses
    with pytest.raises(BlockloopError, match="128 tokens with --gen-len 200; give --prompt-len and --gen-len"):
        scenario_lengths("prefill-heavy", [tiny], gen_len=200)


def test_bench_keeps_a_given_length_and_refuses_a_model_it_cannot_fit_before_timing_any(capsys):
    from blockloop.cli import main

    assert main(["bench", "--presets", "tiny", "--device", "cpu", "--prompt-len", "8", "--batch-sizes", "1",
                 "--repeats", "1", "--warmup", "0", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "the paper's 2048 tokens (--gen-len) shortened to 120" in out and "prompt 8, generate 120" in out
    # demo (256-token context) fits 100 + 100, tiny (128) does not: refused before demo is timed.
    assert main(["bench", "--presets", "demo,tiny", "--device", "cpu", "--prompt-len", "100", "--gen-len", "100"]) == 2
    captured = capsys.readouterr()
    assert "tiny: prompt 100 + generation 100, a slot of 200 tokens exceeds the model context of 128" in captured.err
    assert "measured copy bandwidth" not in captured.out


def test_a_compiled_stream_compiles_before_its_clock_starts(monkeypatch):
    """A compiled step takes tens of seconds per row count on a GPU; compiled inside the timed stream it was counted
    as queueing and serving (the GPU suite's recursive row compiles with 128 slots). Dynamo keeps one graph per step
    and shape for the runner, which the fake below imitates with a one-second compile."""
    import time

    from blockloop.bench.stream import run_stream

    compiled = set()

    def fake_compile(step, **options):
        def run(tokens, *args, **kwargs):
            key = (id(step.__self__), tuple(tokens.shape))
            if key not in compiled:
                compiled.add(key)
                time.sleep(1.0)
            return step(tokens, *args, **kwargs)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    metrics = run_stream(tiny(), random_prompts((4, 7, 5, 6, 3)), n_slots=4, min_tokens=3, max_tokens=5, rate=200.0,
                         sync_every=2, compile=True)
    assert len(compiled) >= 2  # several row counts were compiled, all before the stream
    assert metrics["requests"] == 5 and metrics["e2e_s"]["p99"] < 0.5


def test_a_stream_warms_up_before_its_clock_starts_and_counts_only_its_timed_part():
    """The first model of a stream benchmark is the baseline every ratio divides by: timed cold (allocator, kernel
    and library start-up, imitated by a one-second first step) it made every later model look faster. The warm-up
    is served before the clock, and a depth-wise runner's steps and exit counts leave it out."""
    import time

    from blockloop.bench.stream import run_stream

    def cold(runner):
        step, calls = runner.decode_step, []

        def first_slow(*args, **kwargs):
            if not calls:
                time.sleep(1.0)
            calls.append(1)
            return step(*args, **kwargs)
        runner.decode_step = first_slow
        return runner

    prompts = random_prompts((4, 7, 5, 6, 3))
    kwargs = dict(n_slots=2, min_tokens=3, max_tokens=5, sync_every=2)
    assert run_stream(cold(runner_for(tiny())), prompts, warmup=0, **kwargs)["e2e_s"]["p99"] >= 1.0
    assert run_stream(cold(runner_for(tiny())), prompts, warmup=1, **kwargs)["e2e_s"]["p99"] < 0.5
    model = tiny("tiny-recursive")
    cold_run, warm_run = (run_stream(runner_for(model, **DEPTHWISE), prompts, warmup=w, **kwargs) for w in (0, 2))
    assert warm_run["warmup"] == 2 and warm_run["outputs"] == cold_run["outputs"]
    assert warm_run["steps"] == cold_run["steps"] and 1.0 < warm_run["mean_exit_loop"] == cold_run["mean_exit_loop"] < 2.0


@pytest.mark.slow
def test_compiled_benchmark_engines_each_compile_within_dynamos_recompile_limit():
    """Every engine's decode step is one code object to dynamo: past its recompile limit (8) a step runs eagerly, so
    the GPU suite (an engine per model, batch size and cache) timed its later engines uncompiled. Here the limit is 1
    and hitting it raises: each timed engine must start from fresh compile caches. In a process of its own: dynamo's
    and inductor's state from the rest of the suite must not decide it."""
    import subprocess
    import sys

    script = """
import torch
from blockloop.bench.throughput import engine_throughput
from blockloop.families import build_model, from_name
torch.manual_seed(0)
model = build_model(from_name("tiny")).double().eval()
with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
    for batch in (1, 2):
        result = engine_throughput(model, "tiny", batch, 4, 3, repeats=1, warmup=0, compile=True)
        assert result.tok_s > 0 and result.compile_s > 0  # compiled before the runs, timed apart
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_seeds_that_differ_by_a_multiple_of_2_to_the_32_draw_different_streams():
    """A seed is any int64; its high word used to be dropped, so seeds s and s + 2**32 sampled the same text.
    Every stream a seed keys (its own, and the speculative substreams) depends on both words."""
    from blockloop.serve.sampling import counter_uniform, substream

    seeds = torch.tensor([7, 7 + 2**32, 7 - 2**32, -(2**63), 2**63 - 1 - (2**63 - 1) % 2**32 + 7])
    counter = torch.zeros(len(seeds), dtype=torch.long)
    draws = counter_uniform(seeds, counter, 64)
    assert len({tuple(row.tolist()) for row in draws}) == len(seeds)
    for stream in (2, 3):
        assert len(set(substream(seeds, stream).tolist())) == len(seeds)
    assert ((draws > 0) & (draws < 1)).all()


@pytest.mark.parametrize("paging", [None, Paging(64, 16)], ids=["static", "paged"])
def test_a_cache_that_would_not_fit_the_free_memory_is_refused_before_it_is_allocated(monkeypatch, paging):
    """On CPU, Linux overcommits: an oversized cache (serve --slots 100000) was not refused by the allocator but
    got the server killed by the kernel while zeroing it, without a word. Now it is named, with the flag to turn."""
    from blockloop import device as device_module
    from blockloop.bench.throughput import search_batches

    free = device_module.free_memory("cpu")
    assert free is None or free > 0  # Linux's MemAvailable where there is one
    monkeypatch.setattr(device_module, "free_memory", lambda device: 10_000)
    fix = r"give the paged cache fewer tokens \(--kv-tokens\)" if paging else r"serve fewer slots \(--slots\)"
    with pytest.raises(device_module.OutOfMemory, match=r"a cache buffer of 0.00 GiB would not fit the 0.00 GiB free on cpu; " + fix):
        Engine(runner_for(tiny(), paging=paging), 4)
    # it is torch's out-of-memory error too: a benchmark's batch search stops at the largest batch that fits
    assert search_batches(lambda batch: Engine(tiny(), batch), [1, 2], search=False, max_batch=2) == []
    monkeypatch.setattr(device_module, "free_memory", lambda device: 10**9)
    assert len(search_batches(lambda batch: Engine(tiny(), batch), [1, 2], search=False, max_batch=2)) == 2


def test_a_model_whose_logits_turn_nan_fails_its_requests_instead_of_emitting_garbage():
    """A forward that turns NaN (a checkpoint's finite weights can overflow; here the final norm's gain is inf, so
    its products are NaN): argmax over NaN logits is token 0 every step, which generate printed as NUL bytes and the
    server returned with status 200."""
    broken = tiny()
    with torch.no_grad():
        broken.norm.weight.fill_(math.inf)
    engine = Engine(broken, 2, sync_every=3)
    requests = [engine.submit([5, 6, 7], 4, sampling=SamplingParams(temperature=0.0)) for _ in range(2)]
    with pytest.raises(BlockloopError, match=r"the model's logits are not finite \(NaN or infinite\) for 2 of the 2 "
                                             r"running requests, in torch.float64: the weights overflow"):
        engine.run()
    assert all(r.finished and r.finish_reason == "abort" and r.output == [] for r in requests) and engine.idle
    with pytest.raises(BlockloopError, match="not finite"):
        generate(broken, [[5, 6, 7]], 4, temperature=0)
    healthy = Engine(tiny(), 1)  # the check passes a sound model's requests through
    request = healthy.submit([5, 6, 7], 4, sampling=SamplingParams(temperature=0.0))
    healthy.run()
    assert len(request.output) == 4
