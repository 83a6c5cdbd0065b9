"""A decode step over a static cache reads only the leading slots its rows can hold (issue 12, item 1).

The engine tells its runner, before each window, the most tokens a running request can hold by the window's end,
rounded up to one of :func:`key_lengths`; the cache's mask (and so attention) then covers only that many slots. A
bound one token short silently drops a query's newest key, so these tests give the engine *every* length (the bound
is then used exactly) and check outputs against uncached greedy decoding across what moves a row's slots: chunked
prefill, mid-batch joins, a Block Transformer's padded prompts and per-block entries, a double decoder's cross K/V,
speculative drafts, depth-wise loops and preemption. On CPU an eager step reads ``min(furthest query + 1, limit)``
slots, so a wrong limit shows here as it would on a GPU."""

from __future__ import annotations

import pytest
import torch

from blockloop.families import build_model, from_name
from blockloop.serve import engine as engine_module
from blockloop.serve.engine import Engine
from blockloop.serve.generate import generate
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import ExitRule, Paging, Speculation, runner_for
from blockloop.serve.runners.base import key_lengths

GREEDY = SamplingParams(temperature=0.0)


def tiny(name: str):
    torch.manual_seed(0)
    return build_model(from_name(name)).double().eval()


def prompts_of(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 258, (n,), generator=g).tolist() for n in lengths]


def test_key_lengths_step_down_by_about_root_two_in_whole_tiles():
    lengths = key_lengths(2048, 8)
    assert lengths == sorted(lengths) and lengths[-1] == 2048 and len(lengths) == 8
    assert all(n % 16 == 0 for n in lengths)
    assert all(1.3 < b / a < 1.5 for a, b in zip(lengths, lengths[1:]))
    assert key_lengths(2048, 0) == key_lengths(2048, 1) == [2048]
    assert key_lengths(7, 8) == [7]  # nothing below a whole tile under 16 slots
    assert key_lengths(100, 3) == [64, 80, 100]


def served(name, options, key_buckets, sync_every):
    """An engine over ``name`` with two slots, and the logits of its busy rows at every decode step."""
    runner = runner_for(tiny(name), **options)
    seen, step = [], runner.decode_step

    def recorded(tokens):  # the engine takes the step when built
        out = step(tokens)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        busy = sorted(set(engine.scheduler.running) - set(engine.prefilling))
        seen.append(logits[busy].clone())
        return out

    runner.decode_step = recorded
    engine = Engine(runner, 2, sync_every=sync_every, prefill_chunk=5, max_len=96, key_buckets=key_buckets)
    return engine, seen


@pytest.mark.parametrize("name,options,sync_every", [
    ("tiny", {}, 3), ("tiny", {}, 1), ("tiny-ladder", {}, 2), ("tiny-block", {}, 4), ("tiny-double", {}, 3),
    ("tiny-encdec", {}, 2),
    ("tiny-recursive", {"speculation": Speculation(k=2)}, 2),
    ("tiny-recursive", {"exit_rule": ExitRule("none")}, 3),
    ("tiny", {"paging": Paging(48, page_size=4)}, 2),  # too few pages for both: the newest request is preempted
])
def test_an_engine_cut_to_its_exact_bound_steps_like_one_reading_every_slot(name, options, sync_every, monkeypatch):
    """Every busy row's logits at every step equal those of the same engine reading all ``max_len`` slots (a
    dropped key changes them; greedy tokens of a tiny random model often survive it), and the outputs are
    uncached greedy decoding's."""
    exact = list(range(1, 97))
    monkeypatch.setattr(engine_module, "key_lengths", lambda max_len, count: exact if count else [max_len])
    runs = []
    for key_buckets in (1, 0):
        engine, seen = served(name, options, key_buckets, sync_every)
        limits, limit_keys = [], engine.runner.limit_keys
        engine.runner.limit_keys = lambda n, limit_keys=limit_keys, limits=limits: limits.append(n) or limit_keys(n)
        prompts, budgets = prompts_of((13, 4, 9)), [21, 17, 11]
        requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts[:2], budgets[:2])]
        engine.step()
        requests.append(engine.submit(prompts[2], budgets[2], sampling=GREEDY))  # joins when a slot frees
        engine.run()
        runs.append((seen, requests, limits))
    (cut, requests, limits), (whole, reference, _) = runs
    assert len(cut) == len(whole) >= 8
    for mine, theirs in zip(cut, whole):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-10)
    model = engine.runner.model  # the same weights in both engines (seeded)
    assert [r.output for r in requests] == [r.output for r in reference]
    assert [r.output for r in requests] == [generate(model, [p], n, temperature=0)[0] for p, n in zip(prompts, budgets)]
    short = [n for n in limits if n < 96]  # a window of one busy row of two is a prefix step, which reads every slot
    assert min(short) < 24 and len(set(short)) > 3  # the bound moved with the rows
    if "paging" in options:
        assert sum(r.preemptions for r in requests) > 0


def test_a_step_over_every_slot_reads_a_short_key_length_a_prefix_step_every_slot_and_a_static_batch_every_slot():
    """Keys are cut where the most rows read them: a compiled step is then one graph per row count plus one per key
    length, not one per pair."""
    model = tiny("tiny")
    engine = Engine(model, 4, max_len=128)
    requests = [engine.submit(p, 3, sampling=GREEDY) for p in prompts_of((5, 7, 4, 6))]
    engine.step()
    cache = engine.runner.state.cache
    assert engine.key_lengths == [16, 32, 48, 64, 96, 128] and cache.limit == 16
    assert all(view.limit == 16 for view in engine.runner.state.prefixes.values())
    engine.run()
    lone = engine.submit(prompts_of((5,))[0], 3, sampling=GREEDY)  # one busy slot of four: a one-row prefix step
    engine.run()
    assert cache.limit == 128 and all(r.finished for r in (*requests, lone))
    assert Engine(model, 4, key_buckets=0).key_lengths == [model.config.context_length]
    double = tiny("tiny-double")
    static = Engine(runner_for(double, prefix=double.cache_prefix([7, 8, 9])), 2)
    assert not static.continuous and static.key_lengths == [static.max_len]  # a static batch sizes its cache to itself
    with pytest.raises(Exception, match="key_buckets"):
        Engine(model, 2, key_buckets=-1)


def test_a_compiled_step_compiles_again_for_a_new_limit_rather_than_reading_a_stale_one():
    """Dynamo must guard on the cache's limit: a graph traced at a short limit, replayed once the rows have grown
    past it, would drop their newest keys. The step runs one graph per limit and equals the eager step."""
    model = tiny("tiny")
    eager, compiled = runner_for(model), runner_for(model)
    for runner in (eager, compiled):
        runner.allocate(2, 64)
        with torch.no_grad():
            runner.prefill_slot(0, torch.arange(1, 12))
            runner.prefill_slot(1, torch.arange(3, 9))
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = compiled.compiled_step(lambda f: torch.compile(f, fullgraph=True, backend=counting_backend))
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=4):
        for i in range(10):  # row 0 writes slots 11 .. 20: past 16 after five steps
            compiled.limit_keys(16 if i < 5 else 32)
            tokens = torch.tensor([5 + i, 9 + i])
            torch.testing.assert_close(step(tokens), eager.decode_step(tokens), rtol=1e-12, atol=1e-12)
    assert len(graphs) == 2
    torch._dynamo.reset()


def counted_graphs(monkeypatch) -> list:
    """The graphs the engine's ``torch.compile`` traces from now on (dynamo only, ``backend`` counting them)."""
    graphs, compile = [], torch.compile

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda f, **kw: compile(f, backend=counting, dynamic=False))
    return graphs


def test_a_compiled_engine_compiles_a_graph_per_key_length_past_dynamos_own_limit(monkeypatch):
    """Each key length is one more graph per row count; past dynamo's recompile limit a step would run eagerly
    (here: raise), so the engine allows its steps the limit times its number of key lengths."""
    model = tiny("tiny")
    graphs = counted_graphs(monkeypatch)
    prompts, budgets = prompts_of((5, 9)), [60, 40]
    outputs = []
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for compiled in (True, False):
            engine = Engine(model, 2, max_len=128, sync_every=4, compile=compiled)
            requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
            engine.run()
            outputs.append([r.output for r in requests])
    torch._dynamo.reset()
    assert outputs[0] == outputs[1]
    assert len(graphs) > 2  # key lengths 16 .. 96 (at most two row counts among them)


def test_compile_steps_compiles_every_graph_a_run_then_takes(monkeypatch):
    """After ``compile_steps`` requests of any length and number take no new graph (none is compiled while they
    run), and the outputs are the eager engine's; it refuses an engine already serving and a row count it never
    steps."""
    model = tiny("tiny")
    graphs = counted_graphs(monkeypatch)
    prompts, budgets = prompts_of((5, 40, 9)), [50, 30, 8]
    with torch._dynamo.config.patch(recompile_limit=8):
        engine = Engine(model, 4, max_len=96, sync_every=4, compile=True)
        with pytest.raises(Exception, match="not \\[3\\]"):
            engine.compile_steps(rows=[3])
        engine.compile_steps()
        compiled = len(graphs)
        assert len(engine.row_counts) == 3 and len(engine.key_lengths) == 5  # 4 slots; 16 .. 96
        assert compiled == len(engine.row_counts) + len(engine.key_lengths) - 1
        requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
        with pytest.raises(Exception, match="before submitting"):
            engine.compile_steps()
        engine.run()
    torch._dynamo.reset()
    assert len(graphs) == compiled
    eager = Engine(model, 4, max_len=96, sync_every=4)
    reference = [eager.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
    eager.run()
    assert [r.output for r in requests] == [r.output for r in reference]


def test_a_speculative_engine_compiled_for_greedy_requests_compiles_nothing_while_they_run(monkeypatch):
    """A speculative round's graph reads whether every row is greedy; compiled for the engine's default (sampled)
    and run on a greedy stream, every row count compiled again inside the run (the GPU suite's recursive row
    would have passed dynamo's recompile limit at 128 slots and lost the row)."""
    model = tiny("tiny-recursive")
    graphs = counted_graphs(monkeypatch)
    prompts, budgets = prompts_of((5, 20, 9)), [20, 12, 8]
    with torch._dynamo.config.patch(recompile_limit=8):
        engine = Engine(runner_for(model, speculation=Speculation(k=2)), 4, max_len=64, sync_every=4, compile=True)
        engine.compile_steps(sampling=GREEDY)
        compiled = len(graphs)
        requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
        engine.run()
    torch._dynamo.reset()
    assert compiled > 0 and len(graphs) == compiled
    eager = Engine(runner_for(model, speculation=Speculation(k=2)), 4, max_len=64, sync_every=4)
    reference = [eager.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
    eager.run()
    assert [r.output for r in requests] == [r.output for r in reference]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tiny", "tiny-block", "tiny-double"])
def test_a_compiled_cuda_engine_cut_to_key_lengths_decodes_like_one_reading_every_slot(name, monkeypatch):
    """Under CUDA graphs, one graph per row count and per key length, every one replayed as a graph (none skipped),
    all captured by ``compile_steps`` (none during the requests: no step's output is alive at the next, so cudagraph
    trees replay what they captured first, and the state keeps its tensors), and the tokens of the compiled engine
    reading every slot (fp32: kernels over fewer keys may round differently)."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    captured, record = [], cudagraph_trees.CUDAGraphTreeManager.record_function
    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function",
                        lambda self, *args: captured.append(1) or record(self, *args))
    model = tiny(name).to(device="cuda", dtype=torch.float32)
    prompts, budgets = prompts_of((5, 30, 9, 12)), [60, 20, 40, 8]
    outs = []
    counters.clear()
    for key_buckets in (8, 0):
        torch._dynamo.reset()
        engine = Engine(runner_for(model), 4, sync_every=8, compile=True, key_buckets=key_buckets)
        engine.compile_steps()
        before = len(captured)
        requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
        engine.run()
        assert before > 0 and len(captured) == before  # nothing captured while requests ran
        outs.append([r.output for r in requests])
    torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0
    agree = sum(a == b for x, y in zip(*outs) for a, b in zip(x, y)) / sum(budgets)
    assert agree > 0.95


@pytest.mark.parametrize("name,options", [
    ("tiny", {"paging": Paging(256, page_size=8)}), ("tiny-block", {}), ("tiny-double", {}), ("tiny-encdec", {}),
    ("tiny-recursive", {"exit_rule": ExitRule("max_prob", 0.5)}), ("tiny-recursive", {"speculation": Speculation(k=2)}),
    ("tiny-staircase", {}),
])
def test_compile_steps_leaves_every_runner_as_freshly_allocated(name, options):
    """``compile_steps`` runs every static step over idle rows (writing their caches, counters and phases) and then
    puts the state back: the requests after it decode exactly as on an engine that never ran it (here eager: what is
    checked is the state, not the compiler), and over the same tensors (a CUDA graph captured over them stays valid;
    new ones would have every graph captured again inside the first run)."""
    from blockloop.bench.throughput import state_tensors

    model = tiny(name)
    prompts, budgets = prompts_of((5, 11, 7)), [9, 6, 12]
    outputs = []
    for warm in (True, False):
        engine = Engine(runner_for(model, **options), 4, max_len=64, sync_every=4)
        if warm:
            addresses = [t.data_ptr() for t in state_tensors(engine.runner.step_states())]
            engine.compile_steps()
            assert [t.data_ptr() for t in state_tensors(engine.runner.step_states())] == addresses
        requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
        engine.run()
        exits = engine.runner.depth.exits.tolist() if "exit_rule" in options else None  # counted since allocation
        outputs.append(([r.output for r in requests], exits))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("name,options", [
    ("tiny", {"paging": Paging(192, page_size=4)}),
    ("tiny-recursive", {"paging": Paging(192, page_size=4), "exit_rule": ExitRule("none")}),  # depth-wise
    ("tiny-encdec", {"paging": Paging(192, page_size=4)}),
])
def test_a_static_shape_step_gathers_its_key_length_of_a_paged_pool(name, options, monkeypatch):
    """A compiled (or CUDA) step cannot learn its furthest query on the host, so it reads the engine's key length:
    its gathered read of a paged pool too (the CPU read; a server's rows are the model's context long), else every
    step copies each row's ``max_len`` slots out of the pool. Here eager steps take the static-shape branch, and the
    tokens must still be those of eager decoding on the host's branch (computed before the branch is forced; it
    equals uncached decoding, tests/test_engine.py)."""
    from blockloop.nn import paged_cache
    from blockloop.serve.runners import looped_cache

    model = tiny(name)
    prompts, budgets = prompts_of((6, 9)), [12, 10]
    reference = [generate(model, [p], n, temperature=0)[0] for p, n in zip(prompts, budgets)]
    widths = []
    for module in (paged_cache, looped_cache):
        gather = module.gather_rows
        monkeypatch.setattr(module, "gather_rows", lambda *a, gather=gather, **kw: widths.append(kw.get("slots"))
                            or gather(*a, **kw))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    engine = Engine(runner_for(model, **options), 2, sync_every=2, max_len=96)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
    engine.run()
    assert [r.output for r in requests] == reference
    # Both rows stepping, a window's bound in 16 or 32 slots; alone, the last row's is a prefix step (every slot).
    assert set(widths) <= set(engine.key_lengths) and widths.count(16) >= 8 and widths.count(32) >= 4
