"""Staircase family: Staircase, Cached / Global Cached, Feedback Transformer, Ladder, Universal, Transformer-XL.

Each test checks an equivalence or a dependency that a wrong schedule, mask or state would break.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from blockloop.data.loader import PackedSequences, StreamBatches, stream_eval_batches
from blockloop.errors import BlockloopError, ConfigError
from blockloop.families import build_model, config_from_dict, from_name, spec_of
from blockloop.families.ladder import LadderConfig
from blockloop.families.staircase import StaircaseConfig
from blockloop.models.decoder import Decoder
from blockloop.models.recurrent_core import prefix_kv, rotate_prefix
from blockloop.nn.masks import window_mask
from blockloop.nn.rope import rope_angles
from blockloop.serve.generate import generate
from blockloop.serve.runners import runner_for
from blockloop.train.evaluate import evaluate

STAIRCASES = ["tiny-staircase", "tiny-cached-staircase", "tiny-global-staircase", "tiny-feedback"]
LADDERS = ["tiny-ladder", "tiny-ladder-aabb", "tiny-universal", "tiny-transformer-xl"]
ALL = STAIRCASES + LADDERS


def tiny(name: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(from_name(name, **overrides)).double().eval()
    if getattr(model.config, "memory_mix", False):
        with torch.no_grad():  # a non-uniform mix, so the test sees the weights used
            model.memory_weights.copy_(torch.tensor([0.5, -1.0, 1.5], dtype=torch.float64))
    return model


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 258, (batch, length), generator=torch.Generator().manual_seed(seed))


def core_as_decoder(model: torch.nn.Module, order: list[int] | None = None, **overrides) -> Decoder:
    """A vanilla Decoder (``tiny`` with ``overrides``) whose layers are copies of ``model``'s core layers in ``order``."""
    order = list(range(model.config.n_layer)) if order is None else order
    decoder = Decoder(from_name("tiny", n_layer=len(order), n_kv_head=4, **overrides)).double().eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("core.")}
    for i, layer in enumerate(order):
        for k, v in model.core.blocks[layer].state_dict().items():
            state[f"body.blocks.{i}.{k}"] = v
    decoder.load_state_dict(state)
    return decoder


# ------------------------------------------------------------------- configs
@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (StaircaseConfig, {"chunk_size": 4, "step_size": 10}, "multiple of chunk_size"),
        (StaircaseConfig, {"chunk_size": 0, "step_size": 8}, "chunk_size"),
        (StaircaseConfig, {"chunk_size": 4, "step_size": 8, "context_length": 4}, "exceeds context_length"),
        (StaircaseConfig, {"chunk_size": 4, "step_size": 8, "cache_after": 3}, "between 1 and"),
        (StaircaseConfig, {"chunk_size": 4, "step_size": 8, "cache_after": 2}, "leaving no cache"),
        (StaircaseConfig, {"chunk_size": 4, "step_size": 8, "global_cache": True}, "global_cache needs cache_after"),
        (StaircaseConfig, {"chunk_size": 1, "step_size": 8, "cache_after": 2, "memory_mix": True}, "cache_after=1"),
        (LadderConfig, {"n_steps": 0}, "n_steps"),
        (LadderConfig, {"pattern": "abba"}, "pattern"),
        (LadderConfig, {"memory_len": -1}, "memory_len"),
    ],
)
def test_impossible_configs_fail_with_a_sentence(cls, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        cls(n_layer=2, d_model=64, n_head=4, **kwargs)


def test_configs_round_trip_and_derived_sizes():
    for name in ALL:
        config = from_name(name)
        assert config_from_dict(config.to_dict()) == config
    assert from_name("staircase-randomwalk").passes == 8  # Table 6: S=64, C=8
    assert from_name("cached-staircase-enwik8").cache_tokens == 256  # S=260, m=1, C=4
    assert from_name("global-staircase-algorithm").cache_tokens == from_name("global-staircase-algorithm").context_length


@pytest.mark.parametrize(
    "name, fields, total",
    [("transformer-xl-reddit", {}, 117e6), ("staircase-reddit", {}, 117e6), ("ladder-reddit", {}, 117e6),
     ("transformer-xl-reddit", {"n_layer": 16}, 218e6), ("universal-transformer-reddit", {}, 29e6)],
)
def test_reddit_presets_have_table2_parameter_counts(name, fields, total):
    """Table 2 counts embeddings: 117M for the 8-layer d=1024 core, 218M for the 2x baseline, 29M for one layer."""
    with torch.device("meta"):
        model = build_model(from_name(name, **fields))
    assert model.num_parameters() == pytest.approx(total, rel=0.01)


def test_table6_models_of_a_task_have_equal_parameter_counts():
    counts = set()
    for kind in ("staircase", "cached-staircase", "ladder", "transformer-xl", "global-staircase"):
        with torch.device("meta"):
            counts.add(build_model(from_name(f"{kind}-algorithm")).num_parameters())
    assert len(counts) == 1


# ------------------------------------------------- equivalences with the core
def test_staircase_with_one_step_and_full_chunk_is_the_plain_transformer():
    model = tiny("tiny-staircase", chunk_size=24, step_size=24)
    idx = tokens(2, 24)
    torch.testing.assert_close(model(idx)[0], core_as_decoder(model)(idx)[0])


@pytest.mark.parametrize("attn_scalar", [None, 1.0, 7.0])
def test_staircase_run_as_a_decoder_equals_the_decoder_for_any_attn_scalar(attn_scalar):
    """The core's prefix attention scales scores by the config's attn_scalar^-1/2, as the decoder's does."""
    model = tiny("tiny-staircase", chunk_size=24, step_size=24, attn_scalar=attn_scalar)
    decoder = core_as_decoder(model, attn_scalar=attn_scalar)
    idx = tokens(2, 24)
    torch.testing.assert_close(model(idx)[0], decoder(idx)[0])


def test_ladder_with_one_step_is_the_core_and_universal_is_one_layer_repeated():
    model = tiny("tiny-ladder", n_steps=1)
    idx = tokens(2, 30)
    torch.testing.assert_close(model(idx)[0], core_as_decoder(model)(idx)[0])
    universal = tiny("tiny-universal")
    torch.testing.assert_close(universal(idx)[0], core_as_decoder(universal, [0, 0, 0, 0])(idx)[0])


@pytest.mark.parametrize("pattern, order", [("abab", [0, 1, 0, 1, 0, 1]), ("aabb", [0, 0, 0, 1, 1, 1])])
def test_ladder_patterns_run_the_shared_layers_in_table4_order(pattern, order):
    model = tiny("tiny-ladder", n_steps=3, pattern=pattern)
    assert model.config.execution_order == order
    idx = tokens(2, 20)
    torch.testing.assert_close(model(idx)[0], core_as_decoder(model, order)(idx)[0])
    other = tiny("tiny-ladder", n_steps=3, pattern="aabb" if pattern == "abab" else "abab")
    assert not torch.allclose(model(idx)[0], other(idx)[0])  # same weights, another function


# ---------------------------------------------- the staircase schedule vs a naive one
def naive_staircase(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Section 3.2 from its index arithmetic: at step t the chunks t-N+1..t are active, chunk j with input
    state h^(t-j); a cached chunk's state is fixed once it has its N passes and is visible to the steps
    whose oldest active chunk is at most cache_tokens/C (or, global, any number of) chunks later."""
    c = model.config
    C, N = c.chunk_size, c.passes
    x = model.embed(idx)
    n_chunks = math.ceil(idx.shape[1] / C)
    states = {(j, 0): x[:, j * C : (j + 1) * C] for j in range(n_chunks)}
    cached: dict[int, torch.Tensor] = {}
    for t in range(n_chunks + N - 1):
        active = [j for j in range(t - N + 1, t + 1) if 0 <= j < n_chunks]
        h = torch.cat([states[(j, t - j)] for j in active], dim=1)
        reach = []
        if c.cache_after:
            oldest = 0 if c.global_cache else active[0] - c.cache_tokens // C
            reach = [cached[j] for j in range(max(oldest, 0), active[0])]
        prefix = torch.cat(reach, dim=1) if reach else h[:, :0]
        cos, sin = rope_angles(torch.arange(prefix.shape[1] + h.shape[1]), c.rotary_dim, c.rope_base)
        P = prefix.shape[1]
        mask = window_mask(torch.ones(idx.shape[0], P, dtype=torch.bool), torch.ones(h.shape[:2], dtype=torch.bool))
        layers = [h]
        for block in model.core.blocks:
            kv = rotate_prefix(prefix_kv(block, prefix), cos[:P], sin[:P]) if P else None
            h = block(h, cos[P:], sin[P:], mask=mask, prefix=kv)
            layers.append(h)
        sizes = [states[(j, 0)].shape[1] for j in active]
        for j, piece, *per_layer in zip(active, h.split(sizes, 1), *[s.split(sizes, 1) for s in layers]):
            states[(j, t - j + 1)] = piece
            if t - j + 1 == N:
                weights = torch.softmax(model.memory_weights, 0) if c.memory_mix else None
                cached[j] = sum(w * s for w, s in zip(weights, per_layer)) if c.memory_mix else piece
    out = torch.cat([states[(j, N)] for j in range(n_chunks)], dim=1)
    return model.logits(model.norm(out))


@pytest.mark.parametrize("name", STAIRCASES)
def test_staircase_variants_attend_to_the_states_the_paper_says(name):
    model = tiny(name)
    idx = tokens(2, 38)  # not a multiple of C: the last chunk is partial
    torch.testing.assert_close(model(idx)[0], naive_staircase(model, idx))


def test_the_cache_keeps_s_minus_mc_states_and_the_global_cache_keeps_all():
    idx = tokens(1, 48)
    local = tiny("tiny-global-staircase", global_cache=False)  # C=4, S=8, m=1: one cached chunk
    glob = tiny("tiny-global-staircase")
    assert local(idx, return_state=True)[2].cache_valid.shape[1] == 4
    assert glob(idx, return_state=True)[2].cache_valid.shape[1] == 48


def test_feedback_memory_is_the_softmax_mix_of_all_layers():
    model = tiny("tiny-feedback")
    idx = tokens(2, 12)
    state = model.initial_state(2)
    x = model.embed(idx)
    valid = torch.ones_like(idx, dtype=torch.bool)
    state, _ = model.step(state, x[:, :1], valid[:, :1])
    # Rebuild the first memory vector by hand: embedding and both layer outputs, softmax-weighted.
    cos, sin = rope_angles(torch.arange(1), model.config.rotary_dim, model.config.rope_base)
    h1 = model.core.blocks[0](x[:, :1], cos, sin, mask=None)
    h2 = model.core.blocks[1](h1, cos, sin, mask=None)
    w = torch.softmax(model.memory_weights, 0)
    memory = w[0] * x[:, :1] + w[1] * h1 + w[2] * h2
    for block, (k, v) in zip(model.core.blocks, state.cache):
        k_ref, v_ref = prefix_kv(block, memory)
        torch.testing.assert_close((k, v), (k_ref, v_ref))
    assert state.cache[0][0].shape[2] == 1  # one memory vector per time step
    for _ in range(20):  # the memory keeps the S - 1 most recent steps
        state, _ = model.step(state, x[:, :1], valid[:, :1])
    assert state.cache_valid.shape[1] == model.config.step_size - 1


# --------------------------------------------------------- Transformer-XL memory
def test_transformer_xl_memory_carries_across_segments_within_its_span():
    model = tiny("tiny-transformer-xl")
    first, second = tokens(1, 24, seed=1), tokens(1, 24, seed=2)
    other_first = tokens(1, 24, seed=3)
    _, _, state = model(first, return_state=True)
    _, _, other_state = model(other_first, return_state=True)
    assert not torch.allclose(model(second, state=state)[0], model(second, state=other_state)[0])
    assert torch.allclose(model(second)[0], model(second, state=None)[0])
    # The span: 2 layers x 16 positions back at most; position 40 cannot see position 0.
    idx = torch.cat((first, second), 1)
    changed = idx.clone()
    changed[0, 0] = (idx[0, 0] + 1) % 258
    diff = (model(idx)[0] - model(changed)[0]).abs().amax(-1)[0]
    assert diff[33:].max() == 0 and diff[1:33].max() > 0


def test_memory_length_zero_is_the_plain_decoder_and_keeps_no_state():
    model = tiny("tiny-transformer-xl", memory_len=0)
    idx = tokens(2, 40)
    torch.testing.assert_close(model(idx)[0], core_as_decoder(model)(idx)[0])
    assert model(idx, return_state=True)[2] is None and not spec_of(model.config).recurrent(model.config)


# ------------------------------------------------------- state and generation
@pytest.mark.parametrize("name", [n for n in ALL if spec_of(from_name(n)).recurrent(from_name(n))])
@pytest.mark.parametrize("cuts", [(16, 32), (1, 2, 3, 13, 30, 31)])
def test_a_stream_read_in_segments_gives_the_logits_of_one_forward(name, cuts):
    """Cut anywhere: a segment that ends inside a chunk (or is shorter than one) leaves its tokens pending in the
    state; a staircase's next segment restarted from its last complete chunk, 0.2-0.7 off in logits."""
    model = tiny(name)
    idx = tokens(2, 48)
    full = model(idx)[0]
    pieces, state = [], None
    for start, stop in zip((0, *cuts), (*cuts, 48)):
        logits, _, state = model(idx[:, start:stop], state=state, return_state=True)
        pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full)


@pytest.mark.parametrize("name", ALL)
def test_streaming_generation_logits_equal_the_full_forward(name):
    model = tiny(name)
    idx = tokens(3, 30)
    valid = torch.ones_like(idx, dtype=torch.bool)
    valid[1, :3] = False  # left padding of a shorter prompt
    valid[2, :6] = False
    prompt = 9
    runner = runner_for(model)
    runner.allocate(3, 30)
    steps = [runner.prefill_batch(idx[:, :prompt], valid[:, :prompt])]
    for t in range(prompt, 29):
        steps.append(runner.decode_step(idx[:, t]))
    full = model(idx, token_valid=valid)[0]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, prompt - 1 : 29])


@pytest.mark.parametrize("name", ["tiny-staircase", "tiny-feedback", "tiny-ladder"])
def test_greedy_generation_through_the_shared_loop_is_the_full_forward_argmax(name):
    model = tiny(name)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    out = generate(model, prompts, 6, temperature=0)
    idx = torch.tensor([[0, 0, 0, 0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10]])
    valid = torch.tensor([[False] * 4 + [True] * 3, [True] * 7])
    for _ in range(6):  # the same left padding, re-read from scratch every token
        nxt = model(idx, token_valid=valid)[0][:, -1, :258].argmax(-1)
        idx, valid = torch.cat((idx, nxt[:, None]), 1), torch.cat((valid, torch.ones(2, 1, dtype=torch.bool)), 1)
    assert out == idx[:, 7:].tolist()


# ---------------------------------------------------------------- TBPTT
def test_stream_batches_continue_each_row_and_signal_new_streams():
    data = PackedSequences(np.arange(1000, dtype=np.int64), 10)
    batches = StreamBatches(data, 3, groups=2)
    first, _ = batches.next_batch()
    assert batches.starts_streams
    batches.next_batch()  # the second group's streams
    following, _ = batches.next_batch()
    assert not batches.starts_streams
    torch.testing.assert_close(following[:, 0], first[:, -1] + 1)  # row i goes on where it stopped
    streams = list(stream_eval_batches(data, 4, max_batches=3))
    torch.testing.assert_close(streams[1][0][:, 0], streams[0][0][:, -1] + 1)
    # a resume reads on in the same streams, and only in them (another batch size would index past them)
    again = StreamBatches(data, 3, groups=2)
    again.load_state_dict(batches.state_dict())
    torch.testing.assert_close(again.next_batch()[0], batches.next_batch()[0])
    for other in (StreamBatches(data, 6, groups=2), StreamBatches(data, 3, groups=1),
                  StreamBatches(PackedSequences(np.arange(1000, dtype=np.int64), 20), 3, groups=2)):
        with pytest.raises(BlockloopError, match="resume with the run's own --batch-size, --grad-accum, --seq-len"):
            other.load_state_dict(batches.state_dict())


def test_truncated_bptt_detaches_the_state_and_the_loss_falls(tmp_path):
    from blockloop.data.tokenizers import build_tokenizer
    from blockloop.train.trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    config = from_name("tiny-staircase", dropout=0.0)
    model = build_model(config)
    pattern = np.tile(np.array([5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 0, 11], dtype=np.int64), 400)  # period 12 > C
    data = PackedSequences(pattern, 16)
    train = TrainConfig(steps=30, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=2, eval_interval=30, eval_batches=2,
                        log_interval=30, ckpt_interval=1000, progress=False, device="cpu", grad_accum=2)
    trainer = Trainer(model, config, build_tokenizer("byte"), data, data, train, tmp_path)
    before = trainer.validate()["val_loss"]
    after = trainer.fit()["val_loss"]
    assert after < before / 3
    for state in trainer.stream_states:
        assert state is not None and not any(c.requires_grad for c in state.chunks)


def test_validation_of_a_recurrent_model_carries_state_across_segments():
    model = tiny("tiny-staircase").float()
    data = PackedSequences(tokens(1, 200)[0].numpy(), 16)
    result = evaluate(model, data, batch_size=2, max_batches=3)
    stream_len = len(data) // 2
    logits, targets = [], []
    for s in range(2):  # each stream's first three windows as one long forward
        window = torch.from_numpy(data.tokens[s * stream_len * 16 : s * stream_len * 16 + 49])
        logits.append(model(window[None, :-1])[0])
        targets.append(window[None, 1:])
    loss = torch.nn.functional.cross_entropy(torch.cat(logits).flatten(0, 1), torch.cat(targets).flatten())
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_segments_that_split_a_chunk_are_refused(tmp_path):
    from blockloop.data.tokenizers import build_tokenizer
    from blockloop.errors import BlockloopError
    from blockloop.train.trainer import TrainConfig, Trainer

    config = from_name("tiny-staircase")  # C = 4
    data = PackedSequences(np.arange(2000, dtype=np.int64) % 200, 10)
    with pytest.raises(ConfigError, match="chunk size 4"):
        Trainer(build_model(config), config, build_tokenizer("byte"), data, None,
                TrainConfig(seq_len=10, batch_size=2, device="cpu", progress=False), tmp_path)
    with pytest.raises(BlockloopError, match="chunk size 4"):
        evaluate(build_model(config), data, batch_size=2, max_batches=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tiny-staircase", "tiny-cached-staircase", "tiny-ladder", "tiny-transformer-xl"])
def test_cuda_bf16_forward_backward_and_streaming_match_cpu(name):
    cpu = tiny(name)
    gpu = build_model(from_name(name)).cuda()
    gpu.load_state_dict(cpu.state_dict())
    idx = tokens(2, 64)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, loss = gpu(idx.cuda(), idx.cuda())
    torch.testing.assert_close(got.double().cpu(), cpu(idx)[0], atol=5e-2, rtol=5e-2)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)
    prompts = [idx[0, :20].tolist(), idx[1, :9].tolist()]
    assert generate(gpu.eval(), prompts, 8, temperature=0) == generate(cpu.float().eval(), prompts, 8, temperature=0)


def test_evaluating_a_window_that_splits_a_chunk_names_a_length_that_fits():
    from blockloop.data.loader import PackedSequences
    from blockloop.errors import BlockloopError
    from blockloop.families import build_model, from_name
    from blockloop.train.evaluate import evaluate

    model = build_model(from_name("tiny-staircase"))
    chunk = model.config.chunk_size
    tokens = np.arange(10 * chunk * 8, dtype=np.int64) % model.config.vocab_size
    with pytest.raises(BlockloopError, match=rf"--seq-len {4 * chunk + 2} is not a multiple .* e\.g\. --seq-len {5 * chunk}$"):
        evaluate(model, PackedSequences(tokens, 4 * chunk + 2), batch_size=2)


def test_staircase_speed_benchmark_carries_state_across_steps(monkeypatch):
    """benchmarks/staircase_speed.py times a recurrent model as truncated-BPTT training does: every step after
    the first is given the previous step's state (the family spec says which models are recurrent)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "staircase_speed.py"
    spec = importlib.util.spec_from_file_location("staircase_speed", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    given_state = []
    call = torch.nn.Module.__call__

    def spy(self, *args, **kwargs):
        if kwargs.get("return_state"):
            given_state.append(kwargs.get("state") is not None)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", spy)
    core = {"n_layer": 1, "d_model": 32, "n_head": 2, "n_kv_head": 2, "context_length": 64}
    script.time_train_step("tiny-transformer-xl", {**core, "memory_len": 16}, 2, 16, 2, torch.device("cpu"))
    assert given_state == [False, True, True]
