"""Self-speculative decoding of looped models in the engine (issue 19): greedy output equal to plain greedy
decoding for every row of a continuous batch, the sampled distribution equal to the full model's, caches after
rejections equal to a fresh prefill, and requests that speculate sharing a batch with requests that do not."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from blockloop.cli import main
from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name
from blockloop.serve.engine import Engine
from blockloop.serve.generate import generate
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import ExitRule, Speculation, runner_for
from blockloop.serve.sampling import filter_logits

GREEDY = SamplingParams(temperature=0.0)


def looped(loops: int = 3, scale: float = 1.0, vocab: int | None = None, seed: int = 0):
    """A tiny float64 recursive model; ``scale`` > 1 blows the shared block's matrices up so that later loops
    often change the first loop's prediction (many rejections); at 1 the loops mostly agree (long accepted runs)."""
    torch.manual_seed(seed)
    config = dataclasses.replace(from_name("tiny-recursive"), loops=loops)
    if vocab is not None:
        config = dataclasses.replace(config, vocab_size=vocab)
    model = build_model(config).double().eval()
    with torch.no_grad():
        for p in model.body.parameters():
            if p.ndim == 2:
                p.mul_(scale)
    return model


def serve(runner, n_slots, jobs, *, sync_every=3, late=()):
    """Run ``jobs`` [(prompt, max_tokens, sampling, eos_id)] through an engine, submitting ``late`` ones after
    the first window (they join mid-stream); the requests and each one's (emitted, drafted) rounds."""
    engine = Engine(runner, n_slots, sync_every=sync_every)
    requests = [engine.submit(p, n, sampling=s, eos_id=e) for p, n, s, e in jobs]
    rounds, first = {}, True
    while not engine.idle:
        for r in engine.step():
            if getattr(runner, "speculator", None) is not None:
                decoded = len(r.output) - 1 + (r.finish_reason == "eos")
                rounds[r.id] = runner.speculator.rounds_of(r.slot, len(r.prompt), decoded)
        if first:
            requests += [engine.submit(p, n, sampling=s, eos_id=e) for p, n, s, e in late]
            first = False
    return requests, rounds


def prompts_of(lengths, seed=3, vocab=258):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("scale", [1.0, 5.0])
@pytest.mark.parametrize("speculation", [Speculation(3, 1), Speculation(2, 2), Speculation(4, 1, adaptive=True)])
def test_greedy_speculation_equals_plain_greedy_for_every_row_of_a_continuous_batch(scale, speculation):
    model = looped(3, scale)
    prompts = prompts_of((3, 9, 6, 4, 7, 5, 8))
    budgets = [8, 3, 6, 1, 12, 9, 5]
    reference = [generate(model, [p], n, temperature=0)[0] for p, n in zip(prompts, budgets)]
    jobs = [(p, n, GREEDY, None) for p, n in zip(prompts, budgets)]
    runner = runner_for(model, speculation=speculation)
    requests, rounds = serve(runner, 2, jobs[:5], late=jobs[5:])  # 2 slots: rows join as others finish
    assert [r.output for r in requests] == reference
    offered = [d for r in requests for _, d in rounds[r.id]]
    kept = [e - 1 for r in requests for e, _ in rounds[r.id]]
    assert max(offered) <= speculation.k
    if scale == 1.0:  # the loops agree: whole runs of drafts are kept
        assert max(kept) == speculation.k
    else:  # they disagree: drafts are rejected
        assert any(k < d for k, d in zip(kept, offered))
    for r in requests:  # the rounds cover the decoded tokens, the last one possibly running past the limit
        emitted = [e for e, _ in rounds[r.id]]
        assert sum(emitted[:-1]) < len(r.output) - 1 <= sum(emitted) or len(r.output) == 1 and not emitted


@pytest.mark.parametrize("fields", [{"lora_rank": 2}, {"prefix_len": 2}, {"tying": "sequence"}, {"tying": "cycle_rev"}])
def test_relaxed_models_and_every_tying_speculate_exactly(fields):
    """Per-loop LoRA and prefixes are picked by loop index, and tyings order the shared layers: the draft and
    verification loops must run each loop's own (rows all at one loop, so any tying works)."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(from_name("tiny-recursive"), loops=3, **fields)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2 and p is not model.embed.weight:
                p.add_(torch.randn_like(p) * 0.3)  # nonzero LoRA / prefixes, loops that disagree
    prompts = prompts_of((3, 9, 6, 4))
    reference = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    requests, _ = serve(runner_for(model, speculation=Speculation(3, 2)), 2, [(p, 8, GREEDY, None) for p in prompts])
    assert [r.output for r in requests] == reference


def test_verification_reuses_the_draft_loops_instead_of_recomputing_them(monkeypatch):
    model = looped(4)
    runner = runner_for(model, speculation=Speculation(3, 2))
    engine = Engine(runner, 2, sync_every=1)
    engine.submit([5, 6, 7], 20, sampling=GREEDY)
    engine.step()  # prefill and a first round
    calls = []
    run_loop = model.run_loop
    monkeypatch.setattr(model, "run_loop", lambda x, loop, *a, **kw: calls.append((loop, x.shape[1])) or run_loop(x, loop, *a, **kw))
    engine.step()  # exactly one round
    drafts = [(loop, 1) for _ in range(4) for loop in (0, 1)]  # k + 1 tokens one at a time through loops 0, 1
    assert calls == drafts + [(2, 4), (3, 4)]  # then loops 2, 3 once over all k + 1 positions


def test_a_finished_request_no_longer_sets_the_adaptive_draft_length():
    """Adaptive rounds draft the longest length any row wants: a row whose request has finished must drop out,
    or a long-gone request that was accepting everything keeps every later round at the maximum k."""
    model = looped(3)  # the loops agree: the first request's draft length climbs to k
    runner = runner_for(model, speculation=Speculation(4, 1, adaptive=True))
    engine = Engine(runner, 2, sync_every=1)
    eager = engine.submit(prompts_of((5,))[0], 12, sampling=GREEDY)
    modest = engine.submit(prompts_of((6,), seed=4)[0], 60, sampling=dataclasses.replace(GREEDY, speculate=1))
    while eager.finish_reason is None:
        engine.step()
    assert modest.finish_reason is None
    engine.step()
    assert runner.speculator._draft_length() == 1  # only the running request's own length is left


def test_eos_inside_an_accepted_run_ends_the_request_there():
    model = looped(3, 2.5)
    prompts = prompts_of((5, 7, 4, 6, 8, 3), seed=0)
    free = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    # Row 5's 9th token first appears there, as the first kept draft of a round that keeps 4 (found by search).
    eos = free[5][8]
    assert eos not in free[5][:8]
    runner = runner_for(model, speculation=Speculation(4, 1))
    requests, rounds = serve(runner, 4, [(p, 12, GREEDY, eos) for p in prompts])
    for request, out in zip(requests, free):
        assert request.output == (out[: out.index(eos)] if eos in out else out)
        assert request.finish_reason == ("eos" if eos in out else "length")
    emitted = [e for e, _ in rounds[requests[5].id]]
    decoded = len(requests[5].output)  # the tokens after the prefill's, EOS included
    assert sum(emitted[:-1]) < decoded < sum(emitted)  # the round that emitted EOS went on past it


def test_cache_after_rejections_equals_a_fresh_prefill_of_the_accepted_tokens():
    model = looped(3, 5.0)
    prompt = prompts_of((6,))[0]
    runner = runner_for(model, speculation=Speculation(3, 1))
    engine = Engine(runner, 2, sync_every=4)
    request = engine.submit(prompt, 40, sampling=GREEDY)
    engine.submit(prompts_of((4,), seed=9)[0], 40, sampling=GREEDY)  # a neighbour row
    engine.step()
    engine.step()
    assert not request.finished
    rounds = runner.speculator.rounds_of(request.slot, len(prompt), len(request.output) - 1)
    assert any(e - 1 < d for e, d in rounds), "the run must contain rejections"
    fed = prompt + request.output[:-1]  # the last token is pending: the next round feeds it
    assert int(runner.state.next_slot[request.slot]) == len(fed)
    fresh = runner_for(model)
    fresh.allocate(1, engine.max_len)
    fresh.prefill_slot(0, torch.tensor(fed))
    n = len(fed)
    for ours, theirs in zip(runner.state.cache.layers, fresh.state.cache.layers):
        torch.testing.assert_close(ours.k[request.slot, :, :n], theirs.k[0, :, :n])
        torch.testing.assert_close(ours.v[request.slot, :, :n], theirs.v[0, :, :n])
    assert bool(runner.state.cache.key_valid[request.slot, :n].all())


def test_requests_that_do_not_speculate_share_the_batch_unchanged():
    """Greedy rows: every row equals plain greedy. Sampled rows that do not speculate draw exactly the
    tokens a non-speculative engine draws for them (the engine samples them, from the same stream)."""
    model = looped(3, 5.0)
    prompts = prompts_of((5, 8, 3, 6, 7, 4))
    sampled = [SamplingParams(temperature=0.9, top_k=50, seed=i, speculate=0) for i in range(3)]
    speculating = [SamplingParams(temperature=0.9, seed=10 + i, speculate=k) for i, k in enumerate((1, 3, None))]
    jobs = [(p, 10, s, None) for p, s in zip(prompts, sampled + speculating)]
    greedy_jobs = [(p, 10, dataclasses.replace(GREEDY, speculate=k), None) for p, k in zip(prompts, (0, 2, 0, 3, 1, None))]
    plain, _ = serve(runner_for(model), 3, jobs[:3] + [(p, 10, GREEDY, None) for p in prompts])
    mixed, rounds = serve(runner_for(model, speculation=Speculation(3, 1)), 3, jobs + greedy_jobs)
    assert [r.output for r in mixed[:3]] == [r.output for r in plain[:3]]
    assert [r.output for r in mixed[6:]] == [r.output for r in plain[3:]]
    assert all(len(r.output) == 10 for r in mixed)
    for r, limit in zip(mixed, (0, 0, 0, 1, 3, 3, 0, 2, 0, 3, 1, 3)):
        assert max(d for _, d in rounds[r.id]) == limit


def target_distribution(model, prompt, n_tokens, temperature, top_p):
    """Exact probability of every continuation of ``n_tokens`` tokens under the full model's sampling."""
    vocab = model.config.vocab_size
    sequences = torch.cartesian_prod(*[torch.arange(vocab)] * n_tokens).reshape(-1, n_tokens)
    idx = torch.cat([torch.tensor(prompt).expand(len(sequences), -1), sequences[:, :-1]], 1)
    with torch.no_grad():
        logits, _ = model(idx)
    logits = logits[:, len(prompt) - 1 :, :vocab].reshape(-1, vocab)
    ones = torch.ones(len(logits))
    scaled = filter_logits(logits, ones * temperature, ones.long() * 0, ones * top_p)
    log_probs = scaled.log_softmax(-1).view(len(sequences), n_tokens, vocab)
    return log_probs.gather(-1, sequences[..., None])[..., 0].sum(-1).exp(), sequences


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_sampled_speculation_keeps_the_full_models_distribution(temperature, top_p):
    """Chi-square goodness of fit of N sampled 3-token continuations against the exact target distribution,
    cells with expected count < 5 pooled; the critical value at significance 1e-4 (Wilson-Hilferty), so a
    correct implementation fails this with probability 1e-4 while a wrong rule (e.g. resampling from p after
    a rejection) moves the statistic by far more at this N."""
    model = looped(2, 4.0, vocab=4)
    with torch.no_grad():
        model.norm.weight.mul_(8.0)  # sharper exit logits: the loops' distributions differ (~70% of drafts kept)
    prompt, n_tokens, n = [1, 2, 3], 3, 1200
    probs, sequences = target_distribution(model, prompt, n_tokens, temperature, top_p)
    runner = runner_for(model, speculation=Speculation(1, 1))
    jobs = [(prompt, n_tokens, SamplingParams(temperature, top_p=top_p, seed=seed), None) for seed in range(n)]
    requests, rounds = serve(runner, 256, jobs, sync_every=4)
    kept = [e - 1 for r in requests for e, _ in rounds[r.id]]
    assert 0.1 < sum(kept) / len(kept) < 0.9  # both branches of the rule are exercised
    index = {tuple(s): i for i, s in enumerate(sequences.tolist())}
    counts = torch.zeros(len(sequences), dtype=torch.float64)
    for r in requests:
        counts[index[tuple(r.output)]] += 1
    expected = probs * n
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    z = 3.719  # the standard normal's 1 - 1e-4 quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert statistic < critical, (statistic, critical, df)


def test_speculation_refuses_what_it_cannot_do():
    model = looped(2)
    with pytest.raises(BlockloopError, match="runs 2 loops, not fewer than the model's 2: give 1"):
        runner_for(model, speculation=Speculation(2, 2))
    with pytest.raises(BlockloopError, match="runs 1 loop, so no shallower draft of it exists to speculate with; "
                                             "leave out --speculate"):  # it read "give 1 to 0"
        runner_for(looped(1), speculation=Speculation(2))
    with pytest.raises(BlockloopError, match="k >= 1"):
        Speculation(0)
    with pytest.raises(BlockloopError, match="not both"):
        runner_for(model, speculation=Speculation(2), exit_rule=ExitRule())
    with pytest.raises(BlockloopError, match="at most the runner's k = 2"):
        Engine(runner_for(model, speculation=Speculation(2)), 1).submit([1, 2], 4, sampling=SamplingParams(speculate=3))
    with pytest.raises(BlockloopError, match="does not speculate"):
        Engine(runner_for(model), 1).submit([1, 2], 4, sampling=SamplingParams(speculate=2))
    with pytest.raises(BlockloopError, match="speculate must be a whole number >= 0"):
        SamplingParams(speculate=-1)


def test_bench_stream_reports_acceptance_and_the_same_models_ratio(tmp_path, capsys):
    record = tmp_path / "stream.jsonl"
    assert main(["bench", "--stream", "--presets", "tiny-recursive", "--requests", "4", "--slots", "2",
                 "--prompt-range", "4,8", "--tokens-range", "3,6", "--speculate", "2", "--adaptive-k", "--device", "cpu",
                 "--record", str(record)]) == 0
    plain, speculative = map(json.loads, record.read_text().splitlines())
    assert speculative["name"] == "tiny-recursive speculative adaptive k<=2 draft 1 loop"
    assert speculative["agreement_vs_no_exit"] == 1.0  # greedy speculation is exact
    assert speculative["ratio_vs_same_model"] > 0 and 0.0 <= speculative["acceptance_rate"] <= 1.0
    decoded = speculative["output_tokens"] - 4  # the first token of each request comes from its prefill
    assert decoded / speculative["verification_passes"] == pytest.approx(speculative["tokens_per_pass"])
    assert 1.0 <= speculative["tokens_per_pass"] <= 3.0 and "acceptance_rate" not in plain
    assert "tok/pass" in capsys.readouterr().out


def test_generate_speculates_on_a_looped_run_and_refuses_other_families(tmp_path, capsys):
    run = tmp_path / "rec"
    assert main(["train", "--preset", "tiny-recursive", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                 "--warmup-steps", "1", "--eval-interval", "2", "--eval-batches", "1", "--device", "cpu", "--no-progress",
                 "--out", str(run)]) == 0
    argv = ["generate", "--checkpoint", str(run), "--prompt", "To be", "--max-new-tokens", "12", "--temperature", "0"]
    capsys.readouterr()
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--speculate", "3"]) == 0
    assert capsys.readouterr().out == plain
    with pytest.raises(BlockloopError, match="runner has no option speculation"):
        generate(build_model(from_name("tiny")).eval(), [[1, 2]], 3, speculation=Speculation(2))
