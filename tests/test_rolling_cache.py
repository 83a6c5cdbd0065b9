"""Sliding-window layers keep a rolling KV cache (issue 13, item 2): rings of ``sliding_window`` (+ the speculative
draft length) entries per row instead of the cache length, exact in every serving path: cached = uncached for the
decoder and recursive local/global mixes, lock-step left-padded batches, continuous batching with mid-batch joins,
depth-wise = sequence-wise, speculative rollback, prefix reuse in scoring, and the decode step compiles."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blockloop.config import DecoderConfig
from blockloop.families import build_model, spec_of
from blockloop.families.recursive import RecursiveConfig
from blockloop.nn.kv_cache import KVCache, RollingKVCache, StepContext
from blockloop.serve.engine import Engine
from blockloop.serve.generate import generate
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import ExitRule, Paging, Speculation, runner_for
from blockloop.serve.sampling import SlotSampling

WINDOW = 4
SHAPE = dict(vocab_size=61, context_length=96, n_head=4, n_kv_head=2, d_model=32, d_ff=48, norm="rmsnorm",
             mlp="swiglu", bias=False, sliding_window=WINDOW, local_rope_base=1000.0)
GREEDY = SamplingParams(temperature=0.0)
# Recursive mixes over 3 shared layers: every position local but the given ones (cycle tying).
MIXES = {
    "shared": dict(loops=2, local_layers=[0, 2]),  # each shared layer local at every loop or at none
    "per-depth": dict(loops=2, local_depths=[0, 1, 2, 3, 4]),  # layer 2 local at loop 0, global at loop 1
    "three loops": dict(loops=3, local_layers=[1], local_depths=[0, 5, 6]),  # 0 and 2 mixed, 1 rolling
    "all local": dict(loops=2, local_layers=[0, 1, 2]),  # every entry a ring: the step's global mask still made
}


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Random, unequal weights and norm gains in float64 (attention that differs between positions)."""
    torch.manual_seed(1)
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.2 if p.dim() > 1 else 0.3) * torch.randn_like(p))
    return model


def decoder(local_layers=(0, 2)) -> torch.nn.Module:
    torch.manual_seed(0)
    return perturbed(build_model(DecoderConfig(**SHAPE, n_layer=3, local_layers=list(local_layers))))


def recursive(mix: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return perturbed(build_model(RecursiveConfig(**SHAPE, n_layer=3, lora_rank=2, **MIXES[mix])))


def prompts_of(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 61, (n,), generator=g).tolist() for n in lengths]


def uncached_greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0][0, -1, :61].argmax()))
    return seq[len(prompt):]


MODELS = {"decoder": decoder, **{f"recursive {mix}": (lambda mix=mix: recursive(mix)) for mix in MIXES}}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def test_local_layers_keep_rings_of_the_window_not_the_cache_length():
    m = decoder(local_layers=(0, 2))
    cache = m.allocate_cache(3, 90)
    assert [type(layer) for layer in cache.layers] == [RollingKVCache, KVCache, RollingKVCache]
    ring = WINDOW + 1  # the window and one scratch entry (padding goes there)
    assert [tuple(layer.k.shape) for layer in cache.layers] == [(3, 2, ring, 8), (3, 2, 90, 8), (3, 2, ring, 8)]
    assert cache.ring_slot.shape == (3, ring)
    spec = runner_for(recursive("per-depth"), speculation=Speculation(k=3))
    spec.allocate(2, 90)  # the rings keep room for the 3 drafts a round may take back
    sizes = [layer.k.shape[2] for layer in spec.state.cache.layers]
    assert sizes == [ring + 3, ring + 3, ring + 3, ring + 3, ring + 3, 90]  # layer 2: local at depth 2, global at 5
    sequence_wise = recursive("three loops").allocate_cache(2, 90)  # depths 2, 3 and 8 are global
    assert [layer.k.shape[2] for layer in sequence_wise.layers] == [ring, ring, 90, 90, ring, ring, ring, ring, 90]
    depthwise = runner_for(recursive("three loops"), exit_rule=ExitRule("none"))
    depthwise.allocate(2, 90)
    assert [k.shape[2] for k, _ in depthwise.state.cache.stacked] == [3 * 90, 3 * ring, 3 * 90]  # layer 1: local at every loop
    assert decoder().allocate_cache(1, 3).layers[0].k.shape[2] == 3 + 1  # never more than the cache length


@pytest.mark.parametrize("name", list(MODELS))
def test_kv_bytes_formula_counts_what_the_cache_allocates(name):
    model = MODELS[name]()
    cache = model.allocate_cache(1, 60)
    allocated = sum(layer.k.numel() + layer.v.numel() for layer in cache.layers) * 8
    scratch = sum(2 * layer.k[:, :, :1].numel() for layer in cache.layers if isinstance(layer, RollingKVCache)) * 8
    assert spec_of(model.config).kv_bytes(model.config, 50, 10, 8) == allocated - scratch  # what the rings hold
    global_only = {"local_layers": [], "sliding_window": None, "local_rope_base": None,
                   **({"local_depths": []} if name != "decoder" else {})}
    full = spec_of(model.config).kv_bytes(dataclasses.replace(model.config, **global_only), 50, 10, 8)
    assert allocated < full


def test_cached_forward_in_chunks_equals_the_uncached_forward(model):
    idx = torch.randint(1, 61, (2, 30), generator=torch.Generator().manual_seed(0))
    full = model(idx)[0]
    cache = model.allocate_cache(2, 40)
    outs, start = [], 0
    for size in (9, 1, 3, 1, 1, 7, 2, 6):  # a prefill longer than the ring, then steps shorter and longer
        slots = torch.arange(start, start + size)
        outs.append(model(idx[:, start : start + size], step=StepContext(cache, slots))[0])
        start += size
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-10)


def test_lock_step_left_padded_batch_equals_per_prompt_generation(model):
    prompts = prompts_of((11, 3, 7))
    batched = generate(model, prompts, 14, temperature=0.0)
    assert batched == [uncached_greedy(model, p, 14) for p in prompts]


def test_continuous_batching_with_mid_batch_joins_equals_per_request_generation(model):
    prompts, budgets = prompts_of((9, 2, 13, 5, 6)), [12, 9, 5, 13, 7]
    reference = [uncached_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    engine = Engine(model, 3, sync_every=2, prefill_chunk=5)  # rows join as others finish, each at its own slot
    # Prompts of up to 13 tokens in chunks of 5: a row between its chunks takes the window's decode steps fed no
    # token, which must not push its prompt's keys out of the rings.
    assert engine.runner.chunked_prefill
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
    engine.run()
    assert [r.output for r in requests] == reference


@pytest.mark.parametrize("read", ["gather", "pages"])
@pytest.mark.parametrize("name", ["decoder", "recursive shared", "recursive per-depth"])
def test_paged_global_layers_beside_rolling_local_ones_equal_per_request_generation(name, read):
    """A paged cache for the global layers, rings for the local ones: a small pool (requests wait for pages and
    grow a window at a time, the newest preempted when pages run out) gives exactly each request's own greedy
    continuation, and every page comes back."""
    model = MODELS[name]()
    prompts, budgets = prompts_of((9, 2, 13, 5, 6)), [12, 9, 5, 13, 7]
    reference = [uncached_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    runner = runner_for(model, paging=Paging(32, 4, read))
    engine = Engine(runner, 3, sync_every=2)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
    engine.run()
    assert [r.output for r in requests] == reference and any(r.preemptions for r in requests)
    cache = runner.state.cache
    assert any(isinstance(layer, RollingKVCache) for layer in cache.layers) and cache.pages is not None
    assert len(cache.pages.free) == cache.pages.n_pages - 1 and not cache.pages.held


@pytest.mark.parametrize("read", ["gather", "pages"])
@pytest.mark.parametrize("mix", [mix for mix in MIXES if mix != "all local"])  # all rings: nothing to page
def test_paged_depth_wise_batching_keeps_rings_for_local_layers(mix, read):
    """Depth-wise over pages: shared layers local at every loop keep their rings stacked per loop, the others
    take pages, and a layer local at some loops only (per-depth, three loops) reads its pages through a window
    band at its rows' local loops. Without exits the engine serves each request's uncached greedy continuation
    through a pool small enough that requests wait for pages, and every page comes back."""
    model = recursive(mix)
    prompts, budgets = prompts_of((9, 2, 13, 5), seed=6), [12, 9, 12, 7]
    reference = [uncached_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    runner = runner_for(model, exit_rule=ExitRule("none"), paging=Paging(40, 4, read))
    engine = Engine(runner, 2, sync_every=3)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
    waited = False
    while not engine.idle:
        engine.step()
        waited |= bool(engine.scheduler.waiting) and bool(engine.scheduler.free)
    assert [r.output for r in requests] == reference and waited
    cache = runner.state.cache
    loops = model.config.loops
    rings = [j for j in range(3) if all(model.loop_local[:, j])]
    assert rings == sorted(cache.rolling_layers) and rings != [0, 1, 2]
    assert all(tuple(t.shape[2] for t in cache.stores[j]) == (loops * (WINDOW + 1),) * 2 for j in rings)
    pages = cache.loop_pages
    assert pages.capacity == loops * 40 and len(pages.free) == pages.n_pages - 1 and not pages.held


@pytest.mark.parametrize("read", ["gather", "pages"])
@pytest.mark.parametrize("mix", ["shared", "per-depth"])
def test_paged_depth_wise_early_exits_fill_deeper_pages_and_rings_like_the_static_cache(mix, read):
    """With a real exit rule rows sit at different loops and an exited token's K/V is copied into the loops it
    skipped, in pages (global and mixed layers) and rings (local layers): every step's logits and exits equal the
    static looped cache's, long enough for the rings to wrap (and for a mixed layer's window to slide)."""
    model = recursive(mix)
    rule, rows, steps = ExitRule("max_prob", 0.2), 3, 30
    runners = [runner_for(model, exit_rule=rule), runner_for(model, exit_rule=rule, paging=Paging(3 * 48, 4, read))]
    for runner in runners:
        runner.sampling = SlotSampling.empty(rows, torch.device("cpu"))
        runner.allocate(rows, 48)
        for slot, prompt in enumerate(prompts_of((9, 2, 13), seed=7)):
            assert runner.reserve(slot, len(prompt) + steps)
            runner.prefill_slot(slot, torch.tensor(prompt))
    ready, exits = torch.ones(rows, dtype=torch.bool), 0
    with torch.no_grad():
        for i in range(steps):
            tokens = torch.where(ready, torch.tensor([5 + i, 17 + i, 40 - i]), -1)
            static, paged = (runner.decode_step(tokens) for runner in runners)
            assert torch.equal(static.ready, paged.ready)
            torch.testing.assert_close(paged.logits, static.logits, rtol=0, atol=1e-10)
            exits += int((static.ready & (runners[0].depth.loop < 2)).sum())
            ready = static.ready
    assert exits > 0 and runners[0].mean_exit_loop() == runners[1].mean_exit_loop()


def test_a_chunk_of_mixed_lengths_keeps_padding_out_of_the_rings(model):
    """The runner's chunk forward (rows of different lengths, padding written after each row's real tokens)
    caches exactly, chunk after chunk and for the decode after: padding goes to the scratch entry, never over
    a real key."""
    prompts = prompts_of((12, 8, 9), seed=8)  # the last chunk: 5, 1 and 2 real tokens
    runner = runner_for(model)
    runner.sampling = SlotSampling.empty(3, torch.device("cpu"))
    runner.allocate(3, 40)
    done = [0, 0, 0]
    for width in (5, 2, 6):
        pieces = [p[d : d + width] for p, d in zip(prompts, done)]
        chunks = torch.tensor([[0] * (width - len(piece)) + piece for piece in pieces])
        last = runner.prefill_chunk(0, chunks, torch.tensor([len(piece) for piece in pieces]), torch.tensor(done))
        done = [d + len(piece) for d, piece in zip(done, pieces)]
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(last[row], model(torch.tensor([prompt]))[0][0, -1], rtol=0, atol=1e-10)
    for i in range(WINDOW + 2):  # decoding on reads what the padded chunk left in the rings
        tokens = torch.tensor([5 + i, 17, 30 + i])
        logits = runner.decode_step(tokens)
        for row, prompt in enumerate(prompts):
            prompt.append(int(tokens[row]))
            torch.testing.assert_close(logits[row], model(torch.tensor([prompt]))[0][0, -1], rtol=0, atol=1e-10)


@pytest.mark.parametrize("mix", list(MIXES))
def test_depth_wise_with_early_exits_and_speculation_equal_sequence_wise(mix):
    model = recursive(mix)
    prompts, budgets = prompts_of((9, 2, 13, 5), seed=5), [11, 9, 5, 12]
    reference = [generate(model, [p], n, temperature=0.0)[0] for p, n in zip(prompts, budgets)]  # = uncached (above)
    for kwargs in ({"exit_rule": ExitRule("none")}, {"speculation": Speculation(k=3)},
                   {"speculation": Speculation(k=2, draft_loops=1, adaptive=True)}):
        engine = Engine(runner_for(model, **kwargs), 2, sync_every=3)
        requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
        engine.run()
        assert [r.output for r in requests] == reference, kwargs


def test_early_exits_fill_the_rings_of_deeper_loops(monkeypatch):
    """With a real exit rule, the copy-the-exit-state rule writes the owed loops' ring entries: equal to the same
    runner over full-length caches (the rings changed memory, not what the model computes)."""
    model = recursive("three loops")
    prompts = prompts_of((9, 2, 13, 5), seed=6)

    def serve(ring: int) -> list[list[int]]:
        runner = runner_for(model, exit_rule=ExitRule("max_prob", 0.2))
        engine = Engine(runner, 2, sync_every=3)
        assert runner.state.cache.spans[1] == ring
        requests = [engine.submit(p, 12, sampling=GREEDY) for p in prompts]
        engine.run()
        assert runner.mean_exit_loop() < 3  # some tokens did leave early
        return [r.output for r in requests]

    rolling = serve(WINDOW + 1)
    monkeypatch.setattr(model, "rolling", [])  # the same model over full-length caches: nothing rolls
    assert serve(model.config.context_length) == rolling


@pytest.mark.parametrize("name", ["decoder", "recursive per-depth"])
def test_scoring_reuses_a_prefix_through_the_rings(name):
    """Two questions (left-padded prefixes of different lengths, longer than the ring), choices of several
    lengths: the prefix cached once and taken into each choice's row scores like a forward from scratch."""
    from blockloop.evals.scoring import Request, score

    model = MODELS[name]()
    g = torch.Generator().manual_seed(4)
    draw = lambda n: tuple(torch.randint(1, 61, (n,), generator=g).tolist())  # noqa: E731
    groups = [[Request(context, draw(n)) for n in (3, 6, 1)] for context in (draw(13), draw(8))]
    expected = []
    for r in (r for group in groups for r in group):
        logits = model(torch.tensor([r.context + r.continuation]))[0][0, len(r.context) - 1 : -1]
        expected.append(logits.log_softmax(-1).gather(1, torch.tensor(r.continuation)[:, None]).sum())
    got = score(model, groups).loglikelihood[:, 0]
    torch.testing.assert_close(got, torch.stack(expected), rtol=0, atol=1e-9)


@pytest.mark.parametrize("name, kwargs", [("decoder", {}), ("recursive per-depth", {"exit_rule": ExitRule("none")}),
                                          ("recursive shared", {"speculation": Speculation(k=2)}),
                                          ("recursive shared", {"exit_rule": ExitRule("max_prob", 0.2),
                                                                "paging": Paging(80, 4, "pages")}),
                                          ("recursive per-depth", {"exit_rule": ExitRule("max_prob", 0.2),
                                                                   "paging": Paging(80, 4, "pages")})])
def test_decode_step_over_rings_compiles_as_a_full_graph(name, kwargs):
    model = MODELS[name]()
    runners = [runner_for(model, **kwargs) for _ in range(2)]
    for runner in runners:
        runner.sampling = SlotSampling.empty(2, torch.device("cpu"))
        runner.allocate(2, 40)
        assert runner.reserve(0, 40) and runner.reserve(1, 40)
        runner.prefill_slot(0, torch.arange(1, 10))
        runner.prefill_slot(1, torch.arange(3, 6))
    eager, compiled = runners
    step = torch.compile(compiled.decode_step, fullgraph=True, backend="eager")
    with torch.no_grad():
        for i in range(2 * WINDOW + 1):  # the rings wrap around
            tokens = torch.tensor([5 + i, 17 + 2 * i])
            a, b = step(tokens), eager.decode_step(tokens)
            torch.testing.assert_close(getattr(a, "logits", a), getattr(b, "logits", b), rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()
