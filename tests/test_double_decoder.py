"""Block-based double decoder: masks, the LSE-merged joint softmax, partitions, cached = full forward, prefix reuse."""

from __future__ import annotations

import math

import pytest
import torch

from blockloop.data.collate import step_generator
from blockloop.data.partitions import sample_partition
from blockloop.errors import ConfigError
from blockloop.families import build_model, collate_for, from_name
from blockloop.families.double_decoder import DoubleDecoderConfig
from blockloop.nn.attention import attention, merge_attention
from blockloop.nn.masks import block_ids, block_masks
from blockloop.serve.generate import generate
from blockloop.serve.runners import runner_for


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(from_name("tiny-double")).double().eval()


def random_boundaries(length: int, generator: torch.Generator) -> torch.Tensor:
    return sample_partition(length, "uniform", generator, max_blocks=length)


def dense_joint_softmax(q, k_self, v_self, k_cross, v_cross, boundaries):
    """The paper's "one attention with two different key matrices depending on the (query, key) pair",
    written naively: for every (t, s) pick the within-block or cross-block key, mask, one softmax."""
    length, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
    block = block_ids(boundaries, torch.arange(length))
    out = torch.zeros_like(q)
    for t in range(length):
        scores, values = [], []
        for s in range(length):
            if block[s] == block[t] and s <= t:
                scores.append((q[..., t, :] * k_self[..., s, :]).sum(-1) * scale)
                values.append(v_self[..., s, :])
            elif block[s] < block[t]:
                scores.append((q[..., t, :] * k_cross[..., s, :]).sum(-1) * scale)
                values.append(v_cross[..., s, :])
        weights = torch.softmax(torch.stack(scores, -1), -1)
        out[..., t, :] = (weights.unsqueeze(-1) * torch.stack(values, -2)).sum(-2)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_lse_merged_dual_attention_equals_dense_joint_softmax(seed):
    g = torch.Generator().manual_seed(seed)
    length = 12
    q, ks, vs, kc, vc = (torch.randn(2, 3, length, 8, generator=g, dtype=torch.float64) for _ in range(5))
    boundaries = random_boundaries(length, g)
    within, cross = block_masks(boundaries, length)
    merged, _ = merge_attention(
        *attention(q, ks, vs, mask=within, return_lse=True), *attention(q, kc, vc, mask=cross, return_lse=True)
    )
    want = dense_joint_softmax(q, ks, vs, kc, vc, boundaries)
    assert torch.allclose(merged, want, atol=1e-12)


def test_first_block_rows_have_no_cross_keys_and_stay_well_defined():
    g = torch.Generator().manual_seed(0)
    q, ks, vs, kc, vc = (torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(5))
    boundaries = torch.tensor([0, 3, 6])
    within, cross = block_masks(boundaries, 6)
    assert not cross[:3].any()  # block 0 sees no context
    self_out, self_lse = attention(q, ks, vs, mask=within, return_lse=True)
    cross_out, cross_lse = attention(q, kc, vc, mask=cross, return_lse=True)
    assert torch.isinf(cross_lse[..., :3]).all()
    merged, lse = merge_attention(self_out, self_lse, cross_out, cross_lse)
    assert torch.equal(merged[..., :3, :], self_out[..., :3, :])  # exactly the within-block attention
    merged.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, ks, vs, kc, vc))


@pytest.mark.parametrize("strategy", ["uniform", "logspace", "histogram"])
def test_partitions_cover_the_window_and_masks_never_see_the_future(strategy):
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        b = sample_partition(64, strategy, g, max_blocks=10, lengths=[5, 17, 30])
        assert b[0] == 0 and b[-1] == 64 and (b[1:] > b[:-1]).all()
        within, cross = block_masks(b, 64)
        future = torch.ones(64, 64, dtype=torch.bool).triu(1)
        assert not (within & future).any() and not (cross & future).any()
        assert not (within & cross).any()
        assert within.diagonal().all()  # every query sees at least itself


def test_every_token_is_scored_exactly_once_and_prefix_lm_scores_only_the_suffix(model):
    inputs = torch.randint(0, 258, (3, 40))
    targets = torch.randint(0, 258, (3, 40))
    batch = collate_for(model.config)(inputs, targets, step_generator(0, 5))
    assert torch.equal(batch["targets"], targets)  # the native objective scores every position once
    logits, _ = model(batch["idx"], boundaries=batch["boundaries"])
    assert logits.shape[:2] == targets.shape
    prefix = collate_for(model.config, "prefix_lm")(inputs, targets, step_generator(0, 5))
    b = int(prefix["boundaries"][1])
    assert prefix["boundaries"].tolist() == [0, b, 40]
    assert (prefix["targets"][:, :b] == -100).all() and torch.equal(prefix["targets"][:, b:], targets[:, b:])


def test_changing_future_tokens_changes_no_earlier_logit(model):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 258, (2, 30), generator=g)
    boundaries = random_boundaries(30, g)
    base, _ = model(idx, boundaries=boundaries)
    changed = idx.clone()
    changed[:, 17:] = torch.randint(0, 258, (2, 13), generator=g)
    other, _ = model(changed, boundaries=boundaries)
    assert torch.allclose(base[:, :17], other[:, :17], atol=1e-12)
    assert not torch.allclose(base[:, 17:], other[:, 17:])


def full_forward_logits(model, prompt, generated):
    """Logits of the full forward pass for the partition generation uses: context = prompt[:-1]."""
    idx = torch.tensor([prompt + generated])
    boundaries = torch.tensor([0, len(prompt) - 1, idx.shape[1]]) if len(prompt) > 1 else None
    logits, _ = model(idx, boundaries=boundaries)
    return logits[0, len(prompt) - 1 :]


def test_cached_generation_logits_equal_the_full_forward(model):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 258, (n,), generator=g).tolist() for n in (9, 4, 1)]
    outs = generate(model, prompts, 6, temperature=0)
    for prompt, out in zip(prompts, outs):
        idx = torch.tensor([prompt])
        runner = runner_for(model)
        runner.allocate(1, idx.shape[1] + 6)
        steps = [runner.prefill_batch(idx, torch.ones_like(idx, dtype=torch.bool))[0]]
        for token in out[:-1]:
            steps.append(runner.decode_step(torch.tensor([token]))[0])
        full = full_forward_logits(model, prompt, out[:-1])
        assert torch.allclose(torch.stack(steps), full, atol=1e-10)
        assert out == full.argmax(-1).tolist()


def test_reusing_a_cached_prompt_prefix_gives_identical_outputs(model):
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 258, (11,), generator=g).tolist()
    suffixes = [torch.randint(0, 258, (n,), generator=g).tolist() for n in (5, 2, 1)]
    prefix = model.cache_prefix(shared)
    assert generate(model, [shared + s for s in suffixes], 8, temperature=0) == generate(
        model, suffixes, 8, temperature=0, prefix=prefix
    )
    idx = torch.tensor([shared + suffixes[0]])
    runner = runner_for(model)
    runner.allocate(1, idx.shape[1] + 1)
    want = runner.prefill_batch(idx, torch.ones_like(idx, dtype=torch.bool))
    idx = torch.tensor([suffixes[0]])
    runner = runner_for(model, prefix=prefix)
    runner.allocate(1, idx.shape[1] + 1)
    got = runner.prefill_batch(idx, torch.ones_like(idx, dtype=torch.bool))
    assert torch.allclose(got, want, atol=1e-12)


def test_generation_keeps_a_kv_cache_for_the_generation_layers_only(model):
    idx = torch.randint(0, 258, (2, 10))
    runner = runner_for(model)
    runner.allocate(2, 15)
    runner.prefill_batch(idx, torch.ones_like(idx, dtype=torch.bool))
    state = runner.state
    assert len(state.cache.layers) == model.config.n_generation_layer
    assert len(state.cross) == model.config.n_generation_layer
    assert state.cross[0][0].shape[2] == 9  # context = the prompt but its last token


def test_bad_layer_split_and_unknown_partition_are_config_errors():
    with pytest.raises(ConfigError, match="does not add up"):
        DoubleDecoderConfig(n_layer=12, n_head=4, d_model=64, n_context_layer=8, n_generation_layer=5)
    with pytest.raises(ConfigError, match="partition strategy"):
        DoubleDecoderConfig(n_layer=3, n_head=4, d_model=64, n_context_layer=2, partition="spiral")
    with pytest.raises(ConfigError, match="partition_lengths"):
        DoubleDecoderConfig(n_layer=3, n_head=4, d_model=64, n_context_layer=2, partition="histogram")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flex_dual_attention_forward_backward_and_generation_match_cpu():
    """On CUDA the merged attentions run on FlexAttention (bf16 autocast); compare with the float64 CPU model."""
    torch.manual_seed(0)
    cpu = build_model(from_name("tiny-double")).double()
    gpu = build_model(from_name("tiny-double")).cuda()
    gpu.load_state_dict(cpu.state_dict())
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 258, (2, 128), generator=g)
    boundaries = random_boundaries(128, g)
    want, _ = cpu(idx, boundaries=boundaries)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, loss = gpu(idx.cuda(), idx.cuda(), boundaries=boundaries.cuda())
    torch.testing.assert_close(got.double().cpu(), want, atol=5e-2, rtol=5e-2)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)
    prompts = [idx[0, :20].tolist(), idx[1, :9].tolist()]
    assert generate(gpu.eval(), prompts, 8, temperature=0) == generate(cpu.float().eval(), prompts, 8, temperature=0)
