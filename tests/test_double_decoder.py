"""Block-based double decoder: masks, the joint softmax as one attention call (and as the paper's LSE merge),
the tile-grid BlockMask, partitions, cached = full forward, one cache buffer for both key sets, prefix reuse."""

from __future__ import annotations

import math

import pytest
import torch

from blockloop.data.collate import step_generator
from blockloop.data.partitions import sample_partition
from blockloop.errors import BlockloopError, ConfigError
from blockloop.families import build_model, collate_for, from_name, spec_of
from blockloop.families.costs import kv_cache_bytes
from blockloop.families.double_decoder import DoubleDecoderConfig
from blockloop.models.decoder import merge_heads
from blockloop.nn.attention import attention, merge_attention
from blockloop.nn.kv_cache import DecoderCache, StepContext
from blockloop.nn.masks import block_ids, block_masks, dual_block_mask, dual_mask_mod
from blockloop.nn.rope import rope_angles
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


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex"])
@pytest.mark.parametrize("seed", range(3))
def test_one_attention_call_over_both_key_sets_equals_dense_joint_softmax(seed, backend):
    """Training's form: cross keys before own keys, one call under the tile-grid BlockMask (its mask_mod on the
    dense backends), against the naive joint softmax, float64, with grads finite."""
    g = torch.Generator().manual_seed(seed)
    length = 12
    q, ks, vs, kc, vc = (torch.randn(2, 3, length, 8, generator=g, dtype=torch.float64) for _ in range(5))
    boundaries = random_boundaries(length, g)
    k, v = torch.cat((kc, ks), 2).requires_grad_(backend != "flex"), torch.cat((vc, vs), 2)
    got = attention(q, k, v, block_mask=dual_block_mask(boundaries, length, block_size=4), backend=backend)
    torch.testing.assert_close(got, dense_joint_softmax(q, ks, vs, kc, vc, boundaries), rtol=0, atol=1e-12)
    if backend != "flex":
        got.square().sum().backward()
        assert torch.isfinite(k.grad).all()


@pytest.mark.parametrize("length,block_size", [(12, 4), (37, 8), (64, 16), (130, 16), (33, 7), (5, 128)])
def test_block_mask_from_the_partition_equals_create_block_mask(length, block_size):
    """The BlockMask computed on the tile grid has the same partial and full tiles as FlexAttention's eager
    create_block_mask over the same mask_mod, and the mask_mod is block_masks' two masks side by side."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(length)
    for _ in range(6):
        boundaries = random_boundaries(length, g)
        built = dual_block_mask(boundaries, length, block_size)
        want = create_block_mask(dual_mask_mod(boundaries, length), 1, 1, length, 2 * length, device="cpu",
                                 BLOCK_SIZE=block_size)
        assert torch.equal(built.to_dense(), want.to_dense())
        assert torch.equal(built.kv_num_blocks, want.kv_num_blocks)
        assert torch.equal(built.full_kv_num_blocks, want.full_kv_num_blocks)
        within, cross = block_masks(boundaries, length)
        q, kv = torch.arange(length)[:, None], torch.arange(2 * length)[None, :]
        assert torch.equal(built.mask_mod(0, 0, q, kv), torch.cat((cross, within), -1))


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
    with pytest.raises(BlockloopError, match="at least one token"):
        model.cache_prefix([])
    context = model.config.context_length  # a request past the context names the prefix it counts
    with pytest.raises(BlockloopError, match=f"new tokens after a shared prefix of 11 tokens, in all of {context + 1}"):
        generate(model, suffixes[:1], context - 11 - 5 + 1, temperature=0, prefix=prefix)


def test_generation_holds_one_buffer_per_generation_layer_and_the_kv_bytes_of_the_formula(model):
    """Cross K/V and the generation tokens' own K/V share one buffer per layer: a slot of ``P + G`` tokens holds
    exactly appendix A.1's ``2 d b L_dec (T_in + T_out)`` (the old separate cross buffers held twice that)."""
    c = model.config
    element = model.embed.weight.element_size()
    runner = runner_for(model)
    runner.allocate(3, 15)
    floats = [t for t in runner.state.cache.buffers() if t.is_floating_point()]
    assert len(runner.state.cache.layers) == c.n_generation_layer
    assert sum(t.numel() * t.element_size() for t in floats) == 3 * spec_of(c).kv_bytes(c, 10, 5, element)
    idx = torch.randint(0, 258, (2, 10))
    runner.prefill_batch(idx, torch.ones_like(idx, dtype=torch.bool))
    cache = runner.state.cache
    assert cache.max_len == 15 and cache.key_valid[:, :10].all()  # 9 cross keys + the last prompt token's own
    assert sum(t.numel() * t.element_size() for t in cache.buffers() if t.is_floating_point()) == (
        2 * kv_cache_bytes(c, c.n_generation_layer, 15, element))


@pytest.mark.parametrize("shared", [0, 6])
def test_static_batch_of_left_padded_prompts_equals_each_prompt_alone(model, shared):
    """prefill_batch + decode over left-padded prompts (padding context keys masked out of the one buffer),
    with and without a shared cached prefix, gives each row the logits of its uncached full forward."""
    g = torch.Generator().manual_seed(7)
    common = torch.randint(0, 258, (shared,), generator=g).tolist()
    prompts = [torch.randint(0, 258, (n,), generator=g).tolist() for n in (7, 3, 1)]
    runner = runner_for(model, prefix=model.cache_prefix(common) if shared else None)
    idx = torch.tensor([[0] * (7 - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (7 - len(p)) + [True] * len(p) for p in prompts])
    runner.allocate(3, 7 + 4)
    steps = [runner.prefill_batch(idx, valid)]
    for _ in range(3):
        steps.append(runner.decode_step(steps[-1].argmax(-1)))
    logits = torch.stack(steps, 1)
    for row, prompt in enumerate(prompts):
        full = full_forward_logits(model, common + prompt, logits[row, :-1].argmax(-1).tolist())
        torch.testing.assert_close(logits[row], full, rtol=0, atol=1e-10)


def test_bench_measures_l_dec_over_l_of_the_decoders_kv_state():
    """What `blockloop bench` (and the GPU suite's KV row) reports, the bytes the engine's decode state holds
    per slot, is L_dec / L of the same-size decoder's: one buffer per generation layer, nothing held twice
    (separate max_len-entry cross buffers made it 2 L_dec / L)."""
    from blockloop.bench.throughput import state_bytes

    config = from_name("tiny-double")
    held = []
    for model in (build_model(config), build_model(config.stack(config.n_layer))):
        runner = runner_for(model)
        runner.allocate(4, 64)
        held.append(state_bytes(runner.state))
    assert held[0] / held[1] == pytest.approx(config.n_generation_layer / config.n_layer, rel=0.01)


def old_lse_decode_layer(attn, x, cos, sin, cross, cross_mask, cache, step):
    """The generation layer's attention as it was served before one buffer: the within-block attention over a
    cache of the generation tokens only, the cross attention over separate cross K/V, merged by log-sum-exp."""
    q, k, v = attn.project(x, cos, sin, step.layer(0, cache))
    within = attention(q, k, v, mask=step.begin(), return_lse=True)
    across = attention(q, *cross, mask=cross_mask, return_lse=True)
    return attn.proj(merge_heads(merge_attention(*within, *across)[0]))


def test_single_softmax_decode_equals_the_lse_merged_decode():
    """One attention over the one buffer (cross K/V at slots 0..C-1, own K/V after) = the old two attentions
    merged by log-sum-exp, float64, for rows with different context lengths and left padding, over steps."""
    torch.manual_seed(3)
    model = build_model(from_name("tiny-double")).double().eval()
    attn = model.generation[0].attn
    c, g = model.config, torch.Generator().manual_seed(5)
    context_len, steps = 7, 5
    context_valid = torch.ones(3, context_len, dtype=torch.bool)
    context_valid[1, :3] = context_valid[2, :6] = False  # left padding: rows with 7, 4 and 1 context tokens
    positions = (context_valid.long().cumsum(1) - 1).clamp_min(0)
    latents = torch.randn(3, context_len, c.d_model, generator=g, dtype=torch.float64)
    cross = attn.cross_keys(latents, *rope_angles(positions, c.rotary_dim, c.rope_base))
    cross_mask = context_valid[:, None, None, :]
    fused = DecoderCache(1, 3, c.n_kv_head, context_len + steps, c.head_dim, dtype=torch.float64, device="cpu")
    separate = DecoderCache(1, 3, c.n_kv_head, steps, c.head_dim, dtype=torch.float64, device="cpu")
    fused.layers[0].write(torch.arange(context_len), *cross)
    fused.mark(torch.arange(context_len), context_valid)
    next_position = context_valid.sum(1)
    with torch.no_grad():
        for i in range(steps):
            x = torch.randn(3, 1, c.d_model, generator=g, dtype=torch.float64)
            cos, sin = rope_angles((next_position + i)[:, None], c.rotary_dim, c.rope_base)
            step = StepContext(fused, torch.tensor([context_len + i]))
            got = attn(x, cos, sin, mask=step.begin(), kv=step.layer(0))
            want = old_lse_decode_layer(attn, x, cos, sin, cross, cross_mask, separate.layers[0],
                                        StepContext(separate, torch.tensor([i])))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_engine_rows_joining_and_reusing_slots_give_the_full_forward_logits(model):
    """Continuous batching at the logit level: a row joins while another decodes, then a finished row's slot is
    reused by a shorter prompt (its predecessor's generation keys stay in the buffer, invisible); every step
    equals the uncached forward pass."""
    g = torch.Generator().manual_seed(6)
    first, second, third = (torch.randint(0, 258, (n,), generator=g).tolist() for n in (12, 5, 3))
    runner = runner_for(model)
    runner.allocate(2, 20)
    rows = {0: (first, [runner.prefill_slot(0, torch.tensor(first))])}
    generated = {0: [], 1: []}

    def decode(n):
        for _ in range(n):
            tokens = [int(rows[r][1][-1].argmax()) if r in rows else 0 for r in (0, 1)]
            logits = runner.decode_step(torch.tensor(tokens))
            for r in rows:
                generated[r].append(tokens[r])
                rows[r][1].append(logits[r])

    decode(3)
    rows[1], generated[1] = (second, [runner.prefill_slot(1, torch.tensor(second))]), []
    decode(4)
    finished = rows.pop(0), generated[0]
    rows[0], generated[0] = (third, [runner.prefill_slot(0, torch.tensor(third))]), []
    decode(5)
    for (prompt, logits), out in [(finished[0], finished[1]), *((rows[r], generated[r]) for r in (1, 0))]:
        full = full_forward_logits(model, prompt, out)
        torch.testing.assert_close(torch.stack(logits)[: len(full)], full, rtol=0, atol=1e-10)


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
    """On CUDA the one attention call runs on compiled FlexAttention under the tile-grid BlockMask (bf16 autocast);
    compare with the float64 CPU model."""
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
