"""The paged KV cache (issue 12, item 1): the same numbers as the static cache, memory per request, pages
reused after frees, and a decode step that reads the pool through a block mask and compiles as one graph."""

from __future__ import annotations

import pytest
import torch

from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name
from blockloop.nn.paged_cache import KVPages, PagedKVCache
from blockloop.serve.engine import Engine
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import ExitRule, Paging, Speculation, runner_for
from blockloop.serve.runners.base import StepOutput
from blockloop.serve.sampling import SlotSampling

PROMPTS = [list(range(1, 6)), list(range(3, 20)), [7, 8], list(range(2, 30)), [5] * 11, list(range(40, 49))]


def model_of(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(from_name(name)).double().eval()


def logits_of(out: torch.Tensor | StepOutput) -> torch.Tensor:
    return out.logits if isinstance(out, StepOutput) else out


def test_pages_are_reserved_grown_released_and_reused():
    pages = KVPages(2, 40, n_pages=6, page_size=4, device="cpu")
    assert pages.capacity == 20 and pages.can_hold([20], alone=True) and not pages.can_hold([21], alone=True)
    assert pages.reserve(0, 5)  # 2 pages
    assert pages.reserve(0, 9) and pages.reserve(0, 7)  # grown to 3 pages; reserving less keeps them
    first = list(pages.held[0])
    assert len(first) == 3 and 0 not in first  # page 0 is scratch
    assert pages.table[0, :3].tolist() == first and pages.table[0, 3:].eq(0).all()
    assert pages.owner[first].eq(0).all() and pages.logical[first].tolist() == [0, 1, 2]
    assert pages.can_hold([8]) and not pages.can_hold([9])
    assert not pages.reserve(1, 9) and 1 not in pages.held and len(pages.free) == 2  # no room: nothing taken
    pages.release(0)
    assert pages.owner.eq(-1).all() and pages.table.eq(0).all() and len(pages.free) == 5
    assert pages.reserve(1, 20)
    assert set(first) <= set(pages.held[1])  # freed pages go to the next request
    # The positions of logical slots follow the table; unreserved slots land on the scratch page.
    slots = torch.tensor([[0, 5, 19]])
    assert pages.rows(1, 2).positions(slots).tolist() == [[pages.held[1][0] * 4, pages.held[1][1] * 4 + 1,
                                                           pages.held[1][4] * 4 + 3]]
    assert pages.rows(0, 1).positions(slots).tolist() == [[0, 1, 3]]


def test_an_eager_cpu_step_gathers_the_slots_its_queries_may_see_and_no_more(monkeypatch):
    """The gathered read copies each row's keys out of the pool every layer, every step: a row's first ``max_len``
    slots (a server's are the model's context long) would be copied for a mask that covers the slots up to the
    furthest query's only. A compiled step keeps its static shape (every slot)."""
    pages = KVPages(2, 64, n_pages=12, page_size=4, device="cpu", read="gather")
    assert pages.reserve(0, 10) and pages.reserve(1, 13)
    cache = PagedKVCache(pages, n_kv_head=2, head_dim=3, dtype=torch.float64)
    k, v = torch.randn(2, 2, 1, 3, dtype=torch.float64), torch.randn(2, 2, 1, 3, dtype=torch.float64)
    gathered_k, gathered_v = cache.write(torch.tensor([[9], [12]]), k, v)
    assert gathered_k.shape == gathered_v.shape == (2, 2, 13, 3)
    assert torch.equal(gathered_k[0, :, 9], k[0, :, 0]) and torch.equal(gathered_v[1, :, 12], v[1, :, 0])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert cache.write(torch.tensor([[9], [12]]), k, v)[0].shape[2] == 64
    pages.read = "pages"
    assert cache.write(torch.tensor([[9], [12]]), k, v)[0] is cache.k  # a step reading pages attends over the pool


@pytest.mark.parametrize("read", ["gather", "pages"])
@pytest.mark.parametrize("name", ["tiny", "tiny-recursive", "tiny-ladder", "tiny-encdec"])
def test_paged_runner_equals_the_static_one_through_joins_and_frees(name, read):
    """Rows joining mid-batch, a finished row's pages going to the next request: every step's logits of the
    rows serving a request equal the static cache's (float64; idle rows compute garbage in both)."""
    model = model_of(name)
    static, paged = runner_for(model), runner_for(model, paging=Paging(96, 4, read))
    for runner in (static, paged):
        runner.sampling = SlotSampling.empty(3, torch.device("cpu"))
        runner.allocate(3, 40)
    held, active = [], set()
    with torch.no_grad():
        for event in [("join", 0, 0), ("steps", 3), ("join", 2, 1), ("steps", 4), ("leave", 0), ("join", 0, 3),
                      ("steps", 5), ("join", 1, 4), ("steps", 3)]:
            if event[0] == "join":
                _, slot, prompt = event
                prompt = torch.tensor(PROMPTS[prompt])
                for runner in (static, paged):
                    runner.reserve(slot, len(prompt) + 12)
                held.append(list(paged.state.cache.pages.held[slot]))
                active.add(slot)
                torch.testing.assert_close(paged.prefill_slot(slot, prompt), static.prefill_slot(slot, prompt),
                                           rtol=1e-12, atol=1e-12)
            elif event[0] == "leave":
                for runner in (static, paged):
                    runner.release(event[1])
                active.discard(event[1])
            else:
                for i in range(event[1]):
                    tokens, rows = torch.tensor([3 + i, 9 + 2 * i, 30 - i]), sorted(active)
                    torch.testing.assert_close(logits_of(paged.decode_step(tokens))[rows],
                                               logits_of(static.decode_step(tokens))[rows], rtol=1e-12, atol=1e-12)
    # The request that joined after the first left reuses its pages.
    assert set(held[0]) & set(held[2])


@pytest.mark.parametrize("read, chunk", [("gather", 512), ("pages", 512), ("pages", 5)])
def test_engine_on_a_small_paged_pool_queues_requests_and_matches_the_static_engine(read, chunk):
    model = model_of("tiny")
    outputs = {}
    for label, paging in [("static", None), ("paged", Paging(56, 4, read))]:
        engine = Engine(runner_for(model, paging=paging), n_slots=3, max_len=48, sync_every=4, prefill_chunk=chunk)
        requests = [engine.submit(p, 9) for p in PROMPTS]
        waited_for_pages = False
        while not engine.idle:
            free, waiting = len(engine.scheduler.free), len(engine.scheduler.waiting)
            engine.step()
            admitted = waiting - len(engine.scheduler.waiting)
            waited_for_pages |= bool(engine.scheduler.waiting) and admitted < free
        outputs[label] = [r.output for r in requests]
        # 14 pages: a request waited beside a free slot until pages came back.
        assert waited_for_pages == (paging is not None)
        if paging is not None:
            pages = engine.runner.state.cache.pages
            assert len(pages.free) == pages.n_pages - 1 and not pages.held  # every page came back
    assert outputs["paged"] == outputs["static"]


@pytest.mark.parametrize("read", ["gather", "pages"])
def test_paged_double_decoder_equals_its_static_cache(read):
    """The double decoder's generation cache (each row's cross K/V, then its own) on pages: a request holds its
    whole budget (re-prefilling its output would make it context, not generation: no preemption), requests
    wait for pages, and the greedy outputs equal the static cache's."""
    model = model_of("tiny-double")
    outputs = []
    for paging in (None, Paging(48, 4, read)):
        engine = Engine(runner_for(model, paging=paging), n_slots=3, max_len=48, sync_every=3)
        requests = [engine.submit(p, 16, sampling=SamplingParams(temperature=0.0)) for p in PROMPTS]
        engine.run()
        outputs.append([r.output for r in requests])
        assert not any(r.preemptions for r in requests) and not engine.runner.resumable
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("read", ["gather", "pages"])
def test_paged_block_transformer_equals_its_static_cache_through_joins_and_frees(read):
    """The block decoder's cache (one entry per block) on pages of 2 entries: rows join at block boundaries and
    a finished row's pages go to the next request; every step's logits of the serving rows equal the static
    cache's (float64), the token decoder's one-block cache untouched by paging."""
    model = model_of("tiny-block")
    block = model.config.block_len
    static, paged = runner_for(model), runner_for(model, paging=Paging(32 * block, 2, read))
    for runner in (static, paged):
        runner.sampling = SlotSampling.empty(3, torch.device("cpu"))
        runner.allocate(3, 64)
    assert paged.state.block_cache.pages.capacity == 32 and paged.state.token_cache.pages is None
    prompts = [torch.arange(1, 1 + n * block) % 250 + 1 for n in (1, 3, 2, 5)]
    held, active = [], set()
    with torch.no_grad():
        for event in [("join", 0, 0), ("blocks", 2), ("join", 2, 1), ("blocks", 1), ("leave", 0), ("join", 0, 2),
                      ("blocks", 2), ("join", 1, 3), ("blocks", 1)]:
            if event[0] == "join":
                _, slot, prompt = event
                for runner in (static, paged):
                    assert runner.reserve(slot, len(prompts[prompt]) + 6 * block)
                held.append(list(paged.state.block_cache.pages.held[slot]))
                active.add(slot)
                torch.testing.assert_close(paged.prefill_slot(slot, prompts[prompt]),
                                           static.prefill_slot(slot, prompts[prompt]), rtol=1e-12, atol=1e-12)
            elif event[0] == "leave":
                for runner in (static, paged):
                    runner.release(event[1])
                active.discard(event[1])
            else:
                for i in range(event[1] * block):
                    tokens, rows = torch.tensor([3 + i, 9 + 2 * i, 30 - i]), sorted(active)
                    torch.testing.assert_close(paged.decode_step(tokens)[rows], static.decode_step(tokens)[rows],
                                               rtol=1e-12, atol=1e-12)
    assert len(held[0]) == 4 and set(held[0]) & set(held[2])  # (1 + 6) blocks in pages of 2; reused after the leave


def test_paged_block_transformer_engine_waits_for_pages_and_matches_the_static_engine():
    model = model_of("tiny-block")
    outputs = []
    for paging in (None, Paging(56, 2)):  # 14 block entries in 7 pages: the requests need 2-5 pages each
        engine = Engine(runner_for(model, paging=paging), n_slots=3, max_len=48, sync_every=4)
        requests = [engine.submit(p, 12, sampling=SamplingParams(temperature=0.0)) for p in PROMPTS]
        peak = 0
        while not engine.idle:
            engine.step()
            peak = max(peak, len(engine.admitted))
        outputs.append([r.output for r in requests])
        assert peak == (3 if paging is None else 2)  # with pages, requests waited beside a free slot
        if paging is not None:
            pages = engine.runner.state.block_cache.pages
            assert len(pages.free) == pages.n_pages - 1 and not pages.held  # every page came back
    assert outputs[0] == outputs[1]


def test_paged_speculation_equals_static_speculation():
    model = model_of("tiny-recursive")
    outputs = []
    for paging in (None, Paging(64, 4)):
        engine = Engine(runner_for(model, speculation=Speculation(k=2, draft_loops=1), paging=paging), n_slots=2,
                        max_len=48, sync_every=4)
        requests = [engine.submit(p, 8) for p in PROMPTS[:4]]
        engine.run()
        outputs.append([r.output for r in requests])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("name, options", [("tiny", {}), ("tiny-block", {}), ("tiny-encdec", {}),
                                           ("tiny-recursive", {"exit_rule": ExitRule("max_prob", 0.5)})])
def test_paged_decode_step_compiles_as_one_graph(name, options):
    """One graph (the Block Transformer: one per step kind) that never recompiles as the rows' pages fill."""
    model = model_of(name)
    eager, compiled = (runner_for(model, paging=Paging(64, 4, "pages"), **options) for _ in range(2))
    for runner in (eager, compiled):
        runner.sampling = SlotSampling.empty(2, torch.device("cpu"))
        runner.allocate(2, 40)
        with torch.no_grad():
            for slot, prompt in enumerate((torch.arange(1, 9), torch.arange(3, 11))):
                runner.reserve(slot, 20)
                runner.prefill_slot(slot, prompt)
    step = compiled.compiled_step(lambda f: torch.compile(f, fullgraph=True, backend="eager"))
    try:
        with torch.no_grad():
            for i in range(10):
                tokens = torch.tensor([5 + i, 17 + 2 * i])
                with torch._dynamo.config.patch(error_on_recompile=i > 0):
                    torch.testing.assert_close(logits_of(step(tokens)), logits_of(eager.decode_step(tokens)),
                                               rtol=1e-12, atol=1e-12)
    finally:
        torch._dynamo.reset()


def test_paged_pool_memory_is_the_tokens_asked_for():
    model = model_of("tiny")
    runner = runner_for(model, paging=Paging(64, 8))
    runner.allocate(16, 128)
    c, layer = model.config, runner.state.cache.layers[0]
    assert layer.k.numel() == c.n_kv_head * (64 + 8) * c.head_dim  # 8 pages + scratch, not 16 rows x 128 slots


def test_paging_refuses_what_it_cannot_serve():
    model = model_of("tiny")
    engine = Engine(runner_for(model, paging=Paging(32, 4)), n_slots=2, max_len=48)
    with pytest.raises(BlockloopError, match="whole paged KV cache"):
        engine.submit(list(range(1, 30)), 10)
    with pytest.raises(BlockloopError, match="loop_read picks how a static looped cache is read"):
        runner_for(model_of("tiny-recursive"), exit_rule=ExitRule("max_prob", 0.5), paging=Paging(32), loop_read="dense")
    with pytest.raises(BlockloopError, match="no option paging"):
        runner_for(model_of("tiny-staircase"), paging=Paging(32))
    with pytest.raises(BlockloopError, match=r"keeps only the keys its queries see, a ring per layer .Transformer-XL's span."):
        runner_for(model_of("tiny-transformer-xl"), paging=Paging(32))
    double = model_of("tiny-double")
    with pytest.raises(BlockloopError, match="static batches"):
        runner_for(double, prefix=double.cache_prefix([1, 2, 3]), paging=Paging(32))
    with pytest.raises(BlockloopError, match="paged read"):
        Paging(32, read="dense")
    prefixed = build_model(from_name("tiny-recursive", prefix_len=2))  # appendix K: gathered views only
    for options in ({}, {"exit_rule": ExitRule("none")}):
        with pytest.raises(BlockloopError, match="read='gather'"):
            Engine(runner_for(prefixed, paging=Paging(32, 4, "pages"), **options), n_slots=2, max_len=24)
    engine = Engine(runner_for(prefixed, paging=Paging(32, 4, "gather")), n_slots=2, max_len=24)
    engine.submit([1, 2, 3], 4)
    engine.run()


def test_the_serving_engine_takes_paging_and_the_prefill_chunk():
    from blockloop.serve.http.worker import serving_engine

    model = model_of("tiny")
    engine = serving_engine(model, 2, max_len=48, paging=Paging(64, 4), prefill_chunk=3)
    assert engine.prefill_chunk == 3 and engine.runner.state.cache.pages.capacity == 64
    request = engine.submit(PROMPTS[1], 5)
    engine.run()
    reference = Engine(model, 1, max_len=48)
    alone = reference.submit(PROMPTS[1], 5)
    reference.run()
    assert request.output == alone.output


@pytest.mark.parametrize("chunk", [512, 3])
def test_rows_grow_a_window_at_a_time_and_the_newest_is_preempted_when_pages_run_out(chunk):
    """Requests hold pages for what they have cached plus one window; when a row cannot grow, the newest
    request gives its pages back and is prefilled again later with its output so far. Greedy and seeded
    sampled outputs equal the static engine's, and every page comes back."""
    model = model_of("tiny")
    sampling = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=20, seed=3),
                SamplingParams(temperature=0.7, seed=11), SamplingParams(temperature=0.0)]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[5]]
    outputs = {}
    for label, paging in [("static", None), ("paged", Paging(48, 4))]:
        engine = Engine(runner_for(model, paging=paging), n_slots=3, max_len=48, sync_every=3, prefill_chunk=chunk)
        requests = [engine.submit(p, 24, sampling=s) for p, s in zip(prompts, sampling)]
        engine.run()
        outputs[label] = [r.output for r in requests]
        preempted = sum(r.preemptions for r in requests)
        assert (preempted > 0) == (paging is not None)
        if paging is not None:
            pages = engine.runner.state.cache.pages
            assert len(pages.free) == pages.n_pages - 1 and not pages.held
    assert outputs["paged"] == outputs["static"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_decode_under_cuda_graphs_matches_the_static_cache():
    """On CUDA the paged decode step reads pages through the FlexAttention kernel, or blockloop's Triton kernel
    (``read="kernel"``), eager and inside a CUDA graph."""
    model = model_of("tiny").float().cuda()
    outputs = []
    for paging, compile in ((None, False), (Paging(256, 16), False), (Paging(256, 16), True),
                            (Paging(256, 16, "kernel"), False), (Paging(256, 16, "kernel"), True)):
        engine = Engine(runner_for(model, paging=paging), n_slots=3, max_len=64, sync_every=4, compile=compile)
        requests = [engine.submit(p, 12, sampling=SamplingParams(temperature=0.0)) for p in PROMPTS]
        engine.run()
        outputs.append([r.output for r in requests])
    for other in outputs[1:]:
        agree = sum(a == b for x, y in zip(outputs[0], other) for a, b in zip(x, y)) / sum(map(len, outputs[0]))
        assert agree > 0.9  # float32 kernels differ in the last bits; near-ties can flip late tokens


@pytest.mark.parametrize("tokens, page_size, loops", [(67, 2, 2), (65, 8, 3)])
def test_a_depthwise_pool_holds_its_tokens_at_every_loop_whatever_the_page_size(tokens, page_size, loops):
    """Each loop's table row takes whole pages, so the pool rounds up per loop: a request of exactly ``tokens``
    tokens is admitted depth-wise as it is sequence-wise (it was refused when tokens was not a multiple of the
    page size) and gives the same greedy tokens."""
    torch.manual_seed(0)
    model = build_model(from_name("tiny-recursive", loops=loops)).double().eval()
    prompt = list(range(1, 30))
    outputs = []
    for options in ({}, {"exit_rule": ExitRule("none")}):
        engine = Engine(runner_for(model, paging=Paging(tokens, page_size=page_size), **options), 2, sync_every=4)
        request = engine.submit(prompt, tokens - len(prompt), sampling=SamplingParams(temperature=0.0))
        engine.run()
        outputs.append(request.output)
    assert len(outputs[0]) == tokens - len(prompt) and outputs[0] == outputs[1]


@pytest.mark.parametrize("name, max_len", [("tiny", 160), ("tiny", 100), ("tiny-block", 160), ("tiny-recursive", 150)])
def test_the_benchmarks_paged_pool_holds_the_whole_batch_at_full_length(name, max_len):
    """`bench --paged` times a paged cache, not preemption: every row reserves its whole length at once (the pool
    used to be batch x max_len tokens, too small once rows round up to whole pages, so rows were preempted and
    prefilled again inside the timed run)."""
    from blockloop.bench.throughput import full_batch_paging

    torch.manual_seed(0)
    model = build_model(from_name(name, context_length=256)).eval()
    paging = full_batch_paging(model, 4, max_len)
    runner = runner_for(model, paging=paging)
    runner.sampling = SlotSampling.empty(4, torch.device("cpu"))
    runner.allocate(4, max_len)
    assert all(runner.reserve(slot, max_len) for slot in range(4))
    assert paging.tokens < 4 * max_len * 2  # and no page more than whole pages need


def test_a_pool_smaller_than_one_page_is_refused_in_tokens_a_page_holds():
    """A Block Transformer's page holds page_size blocks: 200 tokens were let through against a "page of 128" and
    rounded up to a 512-token page."""
    with pytest.raises(BlockloopError, match=r"of 200 tokens \(--kv-tokens\) is less than one page of 512 tokens: "
                                             r"128 entries of 4 tokens"):
        Paging(200, 128).pages(2, 64, "cpu", tokens_per_entry=4)
    assert Paging(512, 128).pages(2, 64, "cpu", tokens_per_entry=4).capacity == 128


def test_a_query_at_the_last_slot_sees_no_key_past_the_context_on_a_partly_used_last_page():
    """A 10-slot context on 4-token pages: a row's third page holds slots 8-11, and 10 and 11 lie past the context.
    The pool's mask clamped them to slot 9 for its lookups, so a query at slot 9 (a request filling the context)
    took them for itself and attended to two keys never written. Pool read = gathered read, there too."""
    from blockloop.nn.attention import attention
    from blockloop.nn.masks import cache_mask

    torch.manual_seed(0)
    pages = KVPages(1, 10, n_pages=4, page_size=4, device="cpu", read="pages")
    assert pages.reserve(0, 10)
    cache = PagedKVCache(pages, n_kv_head=1, head_dim=3, dtype=torch.float64)
    k, v = torch.randn(2, 1, 1, 10, 3, dtype=torch.float64)
    gathered_k, gathered_v = cache.write(torch.arange(10), k, v)
    key_valid = torch.ones(1, 10, dtype=torch.bool)
    key_valid[0, 2] = False
    q = torch.randn(1, 2, 1, 3, dtype=torch.float64)
    for query in range(10):
        slots = torch.tensor([[query]])
        pooled = attention(q, cache.k, cache.v, mask=pages.pool_mask(key_valid, slots), backend="eager")
        expected = attention(q, gathered_k, gathered_v, mask=cache_mask(key_valid, slots), backend="eager")
        torch.testing.assert_close(pooled, expected, rtol=1e-12, atol=1e-12)
