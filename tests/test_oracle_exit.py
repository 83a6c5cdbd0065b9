"""Oracle exit in the depth-wise engine (RRT section 3.8, appendix N): the output is no-exit greedy decoding,
each token's exit loop is the first loop agreeing with the last, and the schedule simulation counts steps;
confidence exit against a single-row decoder of the same rule."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import Tensor

from blockloop.cli import main
from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name
from blockloop.nn.kv_cache import StepContext
from blockloop.serve.engine import Engine
from blockloop.serve.exit_schedule import depthwise_steps, sequencewise_steps, simulate, static_steps
from blockloop.serve.generate import generate
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import ExitRule, Paging, runner_for

GREEDY = SamplingParams(temperature=0.0)


def recursive(loops: int = 2, seed: int = 0):
    """A tiny recursive model whose shared block's matrices are scaled up so that a loop changes the
    prediction often (at the default init every loop agrees and the exit check would be vacuous)."""
    torch.manual_seed(seed)
    model = build_model(dataclasses.replace(from_name("tiny-recursive"), loops=loops)).double().eval()
    with torch.no_grad():
        for p in model.body.parameters():
            if p.ndim == 2:
                p.mul_(5.0)
    return model


def brute_force_exits(model, prompt: list[int], output: list[int]) -> list[int]:
    """Full forward over prompt + output: for each decoded token, the first loop (1-based) whose argmax at
    the position that predicted it equals the final loop's argmax there."""
    idx = torch.tensor([prompt + output[:-1]])
    preds = torch.stack([logits[0, :, : model.config.vocab_size].argmax(-1) for logits in model.loop_logits(idx)])
    exits = []
    for position in range(len(prompt), len(prompt) + len(output) - 1):  # output tokens 2.. (decoded ones)
        column = preds[:, position]
        exits.append(int((column == column[-1]).nonzero()[0]) + 1)
    return exits


@pytest.mark.parametrize("loops", [2, 3])
def test_oracle_exit_outputs_equal_no_exit_greedy_and_exits_are_the_first_agreeing_loop(loops):
    model = recursive(loops)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 258, (n,), generator=g).tolist() for n in (3, 9, 6, 4, 7)]
    budgets = [8, 3, 6, 1, 5]
    reference = [generate(model, [p], n, temperature=0)[0] for p, n in zip(prompts, budgets)]
    served = runner_for(model, exit_rule=ExitRule("oracle"))
    engine = Engine(served, 2, sync_every=3)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
    trajectories = {}
    while not engine.idle:  # read each request's exits as it finishes, before its row is reused
        for r in engine.step():
            trajectories[r.id] = served.exit_trajectory(r.slot, len(r.prompt), len(r.output) - 1)
    assert [r.output for r in requests] == reference
    expected = [brute_force_exits(model, p, r.output) for p, r in zip(prompts, requests)]
    assert [trajectories[r.id] for r in requests] == expected
    flat = [k for t in expected for k in t]
    assert min(flat) == 1 and max(flat) <= loops  # the check is not vacuous: some tokens exit early
    assert len(set(flat)) > 1  # ... and some do not


def test_simulated_step_counts_on_a_hand_built_queue():
    # 2 loops, 2 slots; request 0 decodes two tokens exiting after loops 1 and 2, request 1 one token after
    # loop 2, request 2 one token after loop 1.
    # depth-wise: step 1 r0 exits, r1 at loop 1; step 2 r0's 2nd token loop 1, r1 done -> r2 joins;
    #             step 3 r0 done, r2 exits after loop 1: 3 steps.
    # sequence-wise: 2 steps per token in lock-step: r0/r1 at steps 1-2, r0/r2 at steps 3-4: 4 steps.
    # static: batch (r0, r1) runs 2 tokens x 2 loops, batch (r2) 1 x 2: 6 steps.
    queue = [[1, 2], [2], [1]]
    assert depthwise_steps(queue, 2, 2) == 3
    assert sequencewise_steps(queue, 2, 2) == 4
    assert static_steps(queue, 2, 2) == 6
    sim = simulate(queue, 2, 2)
    assert sim["mean_exit_loop"] == 6 / 4 and sim["speedup_vs_sequencewise"] == 4 / 3 and sim["speedup_vs_static"] == 2.0
    # no exits: depth-wise is sequence-wise; one slot: steps are the total loops run
    assert depthwise_steps([[3, 3], [3]], 2, 3) == sequencewise_steps([[1, 2], [3]], 2, 3) == 6
    assert depthwise_steps(queue, 1, 2) == 1 + 2 + 2 + 1
    assert depthwise_steps([[], [2]], 2, 2) == 2  # a request with no decoded token takes no step
    with pytest.raises(BlockloopError, match="exit loops must lie in 1..2"):
        simulate([[3]], 2, 2)
    with pytest.raises(BlockloopError, match="no decoded tokens"):
        simulate([[]], 2, 2)


def test_bench_stream_oracle_reports_full_agreement_and_the_simulation(tmp_path, capsys):
    record = tmp_path / "s.jsonl"
    assert main(["bench", "--stream", "--presets", "tiny-recursive", "--requests", "4", "--slots", "2",
                 "--prompt-range", "4,8", "--tokens-range", "3,6", "--exit", "oracle", "--device", "cpu",
                 "--record", str(record)]) == 0
    sequence_wise, oracle = map(json.loads, record.read_text().splitlines())
    assert oracle["name"] == "tiny-recursive depth-wise exit oracle"
    assert oracle["agreement_vs_no_exit"] == 1.0
    sim = oracle["simulated"]
    assert sim["decoded_tokens"] == oracle["output_tokens"] - 4  # the first token of each comes from prefill
    assert 1.0 <= sim["mean_exit_loop"] == oracle["mean_exit_loop"] <= 2.0
    assert sim["sequencewise_steps"] >= sim["depthwise_steps"] and sim["speedup_vs_sequencewise"] >= 1.0
    assert "speedup vs sequence-wise" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["oracle:0.5", "none:0.9", "none:abc"])
def test_exit_rule_without_threshold_refuses_one(text):
    """``none`` and ``oracle`` read no threshold: a value given to them is refused, not silently ignored."""

    with pytest.raises(BlockloopError, match="reads no threshold"):
        ExitRule.parse(text)
    assert ExitRule.parse(text.split(":")[0]).kind == text.split(":")[0]
    assert ExitRule.parse(text.split(":")[0] + ":0").threshold == 0.0


def single_row_confidence_decode(model, prompt: list[int], n: int, rule: ExitRule) -> tuple[list[int], list[int]]:
    """The documented early-exit semantics written out for one request, token by token and loop by loop over
    the model's plain sequence-wise cache (no depth-wise batching, per-row loops, looped cache or engine): a
    decoded token runs loops until ``rule`` fires on that loop's exit logits (or the last loop), and its K/V of
    the exit loop is copied into the cache entries of the loops it skipped. Returns (output, exit loops)."""
    n_layer, loops = model.config.n_layer, model.config.loops
    cache = model.allocate_cache(1, len(prompt) + n)

    def run(ids: list[int], start: int, exit_early: bool) -> tuple[Tensor, int]:
        step = StepContext(cache, torch.arange(start, start + len(ids)))
        x = model.embed_input(torch.tensor([ids]), step.token_positions)
        inputs = model.loop_inputs(x, step)
        for loop in range(loops):
            x = model.run_loop(x, loop, inputs, step=step)
            logits = model.exit_logits(x[:, -1])
            if exit_early and bool(rule.fires(logits, torch.tensor([loop + 1]))[0]):
                break
        for skipped in range(loop + 1, loops):  # copy the exit state into the skipped loops' entries
            for j in range(n_layer):
                source, target = cache.layers[loop * n_layer + j], cache.layers[skipped * n_layer + j]
                target.k[:, :, start] = source.k[:, :, start]
                target.v[:, :, start] = source.v[:, :, start]
        return logits[0, : model.config.vocab_size], loop + 1

    logits, _ = run(prompt, 0, exit_early=False)  # the prompt runs every loop
    output, exits = [int(logits.argmax())], []
    while len(output) < n:
        logits, exit_loop = run(output[-1:], len(prompt) + len(output) - 1, exit_early=True)
        output.append(int(logits.argmax()))
        exits.append(exit_loop)
    return output, exits


@pytest.mark.parametrize("paging", [None, Paging(2 * 32, 4)], ids=["static", "paged"])
@pytest.mark.parametrize("loops", [2, 3])
def test_confidence_exit_serves_what_a_single_row_decoder_of_the_same_rule_would(loops, paging):
    """Depth-wise batching with a real exit rule (rows at different loops in one step, joins mid-batch, owed K/V
    copied in place) against :func:`single_row_confidence_decode`: the same tokens and the same exit loop for
    every decoded token of every request."""
    model = recursive(loops)
    rule = ExitRule("max_prob", 0.0062)  # the scaled model's top probabilities lie around 0.006: mixed exits
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 258, (n,), generator=g).tolist() for n in (3, 9, 6, 4, 7)]
    budgets = [16, 5, 14, 1, 12]
    expected = [single_row_confidence_decode(model, p, n, rule) for p, n in zip(prompts, budgets)]
    flat = [k for _, exits in expected for k in exits]
    assert min(flat) == 1 and max(flat) == loops  # not vacuous: some tokens leave early, some run every loop
    served = runner_for(model, exit_rule=rule, paging=paging)
    engine = Engine(served, 2, max_len=32, sync_every=3)
    requests = [engine.submit(p, n, sampling=GREEDY) for p, n in zip(prompts, budgets)]
    trajectories = {}
    with torch.no_grad():
        while not engine.idle:
            for r in engine.step():
                trajectories[r.id] = served.exit_trajectory(r.slot, len(r.prompt), len(r.output) - 1)
    assert [(r.output, trajectories[r.id]) for r in requests] == expected
