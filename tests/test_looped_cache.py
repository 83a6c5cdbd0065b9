"""Depth-wise batching reads each row's loop of the looped cache in place (issue 12, item 2): the shared layer's
loops lie one after the other along the key axis, a step writes a row's token into its own loop's part and
attends over the stacked buffers as they are, with a mask that shows the row its loop only. Two masks: a
dense one over every loop (the CPU default) and a FlexAttention block mask that visits only the row's live
blocks of its loop (the CUDA default). Both must serve exactly what sequence-wise decoding serves."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name
from blockloop.models.decoder import LayerInputs
from blockloop.nn.masks import cache_mask
from blockloop.serve.engine import Engine
from blockloop.serve.generate import generate
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import ExitRule, Paging, runner_for
from blockloop.serve.runners.looped_cache import BLOCK, LoopedCache
from blockloop.serve.sampling import SlotSampling

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 6, 7], list(range(10, 21)), [3, 9, 4, 1, 8, 2, 7], [11] * 5, list(range(30, 39))]
BUDGETS = [9, 4, 7, 6, 3]


def looped_model(loops: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    config = dataclasses.replace(from_name("tiny-recursive"), loops=loops)
    return build_model(config).double().eval()


def serve(model: torch.nn.Module, **options) -> tuple[list[list[int]], object]:
    runner = runner_for(model, **options)
    engine = Engine(runner, 2, sync_every=3)  # 5 requests through 2 slots: rows join mid-stream
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(PROMPTS, BUDGETS)]
    engine.run()
    return [r.output for r in requests], runner


@pytest.mark.parametrize("read", ["dense", "blocks"])
def test_depthwise_without_exits_equals_sequence_wise_greedy(read):
    model = looped_model()
    reference = [generate(model, [p], n, temperature=0)[0] for p, n in zip(PROMPTS, BUDGETS)]
    outputs, runner = serve(model, exit_rule=ExitRule("none"), loop_read=read)
    assert runner.state.cache.read == read
    assert outputs == reference


@pytest.mark.parametrize("read", ["dense", "blocks"])
def test_depthwise_logits_equal_sequence_wise_logits(read):
    """Token-level agreement is a weak check on a random model (its argmax barely depends on attention), so the
    logits a row emits after its last loop are compared with sequence-wise decoding of the same tokens, rows
    prefilled to different lengths beside an idle one."""
    model = looped_model()
    depthwise = runner_for(model, exit_rule=ExitRule("none"), loop_read=read)
    sequential = runner_for(model)
    prompts = [torch.arange(1, 9), torch.arange(20, 23)]
    for runner in (depthwise, sequential):
        runner.sampling = SlotSampling.empty(3, torch.device("cpu"))
        runner.allocate(3, 40)
        with torch.no_grad():
            for slot, prompt in enumerate(prompts):
                runner.prefill_slot(slot, prompt)
    fed = torch.tensor([[5, 17, 0], [9, 2, 0], [33, 40, 0], [7, 7, 0]])  # the idle row takes tokens too, as in the engine
    with torch.no_grad():
        for tokens in fed:
            expected = sequential.decode_step(tokens.clamp_min(0))
            out = depthwise.decode_step(tokens)
            for _ in range(model.config.loops - 1):
                assert not out.ready[:2].any()
                out = depthwise.decode_step(torch.full((3,), -1))
            assert out.ready[:2].all()
            torch.testing.assert_close(out.logits[:2], expected[:2], rtol=0, atol=1e-10)


def step_by_step(runners, prompts, steps: int, exit_rule_rows: int = 3) -> None:
    """Drive depth-wise runners with the same tokens (a new one wherever a row is ready) and check that every
    step's logits and ready rows agree across them."""
    for runner in runners:
        runner.sampling = SlotSampling.empty(exit_rule_rows, torch.device("cpu"))
        runner.allocate(exit_rule_rows, 40)
        with torch.no_grad():
            for slot, prompt in enumerate(prompts):
                assert runner.reserve(slot, len(prompt) + steps)
                runner.prefill_slot(slot, prompt)
    ready = torch.ones(exit_rule_rows, dtype=torch.bool)
    with torch.no_grad():
        for i in range(steps):
            tokens = torch.where(ready, torch.tensor([5 + i, 17 + 2 * i, 40 - i]), -1)
            outs = [runner.decode_step(tokens) for runner in runners]
            for out in outs[1:]:
                assert torch.equal(out.ready, outs[0].ready)
                torch.testing.assert_close(out.logits, outs[0].logits, rtol=0, atol=1e-10)
            ready = outs[0].ready


@pytest.mark.parametrize("read", ["gather", "pages"])
def test_paged_depthwise_steps_equal_the_static_looped_cache(read):
    """Paged depth-wise batching (one page-table row per slot and loop, pages of 4) with early exits, so rows sit
    at different loops and exited tokens' K/V are copied into the pages of the loops they skipped."""
    model = looped_model()
    rule = ExitRule("max_prob", 0.012)
    static = runner_for(model, exit_rule=rule)
    paged = runner_for(model, exit_rule=rule, paging=Paging(96, 4, read))
    step_by_step([static, paged], [torch.arange(1, 9), torch.arange(20, 23), torch.arange(7, 19)], steps=24)
    pages = paged.state.cache.loop_pages
    assert pages.table.shape[0] == 3 * 3 and all(len(pages.held[loop * 3 + 1]) == -(-(3 + 24) // 4) for loop in range(3))
    assert static.mean_exit_loop() == paged.mean_exit_loop() < 3


def test_paged_depthwise_engine_waits_for_pages_and_frees_them():
    """A pool of 24 tokens per loop: a request holds its whole budget at every loop from admission (depth-wise
    rows are not preempted), so a longer request runs alone while the next one waits beside a free slot."""
    model = looped_model()
    outputs, waits = [], []
    for paging in (None, Paging(24, 4)):
        runner = runner_for(model, exit_rule=ExitRule("max_prob", 0.012), paging=paging)
        engine = Engine(runner, 2, sync_every=3)
        requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(PROMPTS, BUDGETS)]
        waited_for_pages = False
        while not engine.idle:
            free, waiting = len(engine.scheduler.free), len(engine.scheduler.waiting)
            engine.step()
            waited_for_pages |= bool(engine.scheduler.waiting) and waiting - len(engine.scheduler.waiting) < free
        outputs.append([r.output for r in requests])
        waits.append(waited_for_pages)
    assert outputs[0] == outputs[1] and waits == [False, True]
    pages = runner.state.cache.loop_pages
    assert pages.capacity == 3 * 24 and len(pages.free) == pages.n_pages - 1 and not pages.held


def test_both_reads_serve_the_same_early_exits():
    """With a real exit rule rows sit at different loops in one step, and exited tokens' owed loops hold copies:
    the block mask and the dense mask read the same keys."""
    model = looped_model()
    (dense, dense_runner), (blocks, blocks_runner) = (
        serve(model, exit_rule=ExitRule("max_prob", 0.012), loop_read=read) for read in ("dense", "blocks"))
    assert dense == blocks
    assert 1 < dense_runner.mean_exit_loop() == blocks_runner.mean_exit_loop() < 3  # some tokens did leave early, not all


def test_a_step_attends_over_the_stacked_buffers_without_copying_a_row():
    cache = LoopedCache(1, 3, 2, 2, 10, 4, dtype=torch.float64, device="cpu")
    k_stack, v_stack = cache.stacked[0]
    loop, slots = torch.tensor([2, 0]), torch.tensor([[4], [7]])
    k, v = torch.randn(2, 2, 1, 4, dtype=torch.float64), torch.randn(2, 2, 1, 4, dtype=torch.float64)
    keys, values = cache.loop_layer(0, loop).write(slots, k, v)
    assert keys is k_stack and values is v_stack  # what attention reads is the cache itself
    assert torch.equal(cache.layers[2].k[0, :, 4], k[0, :, 0]) and torch.equal(cache.layers[0].v[1, :, 7], v[1, :, 0])
    assert cache.layers[1].k.abs().sum() == 0  # loop 1 untouched


def test_the_block_mask_visits_only_the_live_blocks_of_each_rows_loop():
    """Row ``b`` at loop ``l`` visits blocks ``l * width ..`` up to its slot's block, and sees in them exactly
    the keys the lifted dense mask shows."""
    max_len, loops = 300, 3  # each loop's span rounds up to 3 blocks of 128
    blocks, dense = (LoopedCache(1, loops, 3, 2, max_len, 4, dtype=torch.float64, device="cpu", read=read)
                     for read in ("blocks", "dense"))
    assert blocks.span == 3 * BLOCK and dense.span == max_len
    key_valid = torch.rand(3, max_len, generator=torch.Generator().manual_seed(0)) < 0.7
    for cache in (blocks, dense):
        cache.key_valid.copy_(key_valid)
    loop, slots = torch.tensor([0, 2, 1]), torch.tensor([[5], [200], [299]])
    mask = blocks.lift(LayerInputs((None, None), {"mask": None}), loop, slots).masks["mask"]
    assert mask.kv_num_blocks.flatten().tolist() == [1, 2, 3]
    width = blocks.span // BLOCK
    for b, n in enumerate([1, 2, 3]):
        assert mask.kv_indices[b, 0, 0, :n].tolist() == [loop[b].item() * width + i for i in range(n)]
    base = cache_mask(key_valid, slots)  # (B, 1, 1, max_len) over one loop's slots
    lifted = dense.lift(LayerInputs((None, None), {"mask": base}), loop, slots).masks["mask"]
    assert lifted.shape == (3, 1, 1, loops * max_len)
    b, kv = torch.meshgrid(torch.arange(3), torch.arange(loops * blocks.span), indexing="ij")
    from_blocks = mask.mask_mod(b, torch.zeros_like(b), torch.zeros_like(b), kv)
    for row in range(3):
        mine = slice(loop[row] * blocks.span, loop[row] * blocks.span + max_len)
        assert torch.equal(from_blocks[row, mine], base[row, 0, 0])
        assert not from_blocks[row].sum() > base[row].sum()  # nothing outside the row's loop
        dense_mine = slice(loop[row] * max_len, (loop[row] + 1) * max_len)
        assert torch.equal(lifted[row, 0, 0, dense_mine], base[row, 0, 0]) and lifted[row].sum() == base[row].sum()


def test_reads_are_checked():
    with pytest.raises(BlockloopError, match="unknown looped-cache read 'pages'"):
        LoopedCache(1, 2, 1, 2, 8, 4, dtype=torch.float32, device="cpu", read="pages")
    with pytest.raises(BlockloopError, match="no rolling"):
        LoopedCache(1, 2, 1, 2, 8, 4, dtype=torch.float32, device="cpu", read="blocks", rolling=[0], window=4)
    local = dataclasses.replace(from_name("tiny-recursive"), sliding_window=4, local_layers=[0])
    with pytest.raises(BlockloopError, match="use loop_read='dense'"):
        runner_for(build_model(local), exit_rule=ExitRule("none"), loop_read="blocks")
    assert runner_for(build_model(local), exit_rule=ExitRule("none")).loop_read == "dense"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_read_on_cuda_equals_the_dense_read_and_compiles():
    """The CUDA default: the block mask through compiled FlexAttention, with and without the engine's compiled
    step (CUDA graphs), serves what the dense read serves (float32: near-ties may flip a late token)."""
    model = looped_model().float().cuda()
    outputs = []
    for read, compile in (("dense", False), ("blocks", False), ("blocks", True)):
        engine = Engine(runner_for(model, exit_rule=ExitRule("max_prob", 0.012), loop_read=read), 2, sync_every=3,
                        compile=compile)
        requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(PROMPTS, BUDGETS)]
        engine.run()
        outputs.append([r.output for r in requests])
    for other in outputs[1:]:
        agree = sum(a == b for x, y in zip(outputs[0], other) for a, b in zip(x, y)) / sum(map(len, outputs[0]))
        assert agree > 0.9
