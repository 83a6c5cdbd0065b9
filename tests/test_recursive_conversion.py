"""Recursive conversion of modern architectures: per-loop norms make equation 4 exact at full rank (Llama,
GPT-NeoX, GPT-2, Gemma-3 and Qwen2 shapes with random, unequal norm gains, q/k and sandwich norms, biases), the
relaxation improves monotonically with the rank, and per-loop norms decode alike in every serving path."""

from __future__ import annotations

import itertools

import pytest
import torch

from blockloop.config import DecoderConfig
from blockloop.convert.to_recursive import input_scales, vanilla_to_recursive
from blockloop.errors import BlockloopError
from blockloop.families import build_model
from blockloop.nn.norm import LoopNorm
from blockloop.serve.engine import Engine
from blockloop.serve.generate import generate
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import ExitRule, runner_for

BASE = dict(vocab_size=97, context_length=64, n_layer=4, n_head=4, n_kv_head=2, d_model=32, d_ff=48)
ARCHS = {
    "llama": dict(norm="rmsnorm", mlp="swiglu", bias=False),
    "neox": dict(norm="layernorm", mlp="gelu", bias=True, parallel_residual=True, rotary_pct=0.25, n_kv_head=4,
                 tie_embeddings=False),
    "gpt2": dict(norm="layernorm", mlp="gelu_tanh", bias=True, learned_positions=True, rotary_pct=0.0, n_kv_head=4),
    "gemma3": dict(norm="rmsnorm1p", mlp="geglu", bias=False, qk_norm=True, sandwich_norm=True, embed_scale=True,
                   attn_scalar=16.0, logit_softcap=30.0),
    # biases on q, k and v alone (their LoRA bias deltas too), and its later layers within a window
    "qwen2": dict(norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True, local_layers=[2, 3], sliding_window=4),
}
FULL_RANK = 32  # min(in, out) over the linears of BASE


def source(arch: str, dtype: torch.dtype = torch.float64, **overrides) -> torch.nn.Module:
    """A tiny full-size model of ``arch`` with random weights, norm gains and biases (unequal in every layer)."""
    torch.manual_seed(0)
    model = build_model(DecoderConfig(**{**BASE, **ARCHS[arch], **overrides})).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_((0.1 if p.dim() > 1 else 0.3) * torch.randn_like(p))
    return model


def tokens(batch: int = 2, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_full_rank_svd_with_per_loop_norms_reproduces_the_original(arch, dtype, atol):
    full = source(arch, dtype)
    idx = tokens()
    for init, tying in (("average", "cycle"), ("stepwise", "sequence")):
        relaxed = vanilla_to_recursive(full, loops=2, init=init, tying=tying, lora_rank=FULL_RANK)
        assert all(isinstance(m.post_attn_norm, LoopNorm) == (arch == "gemma3") for m in relaxed.body.blocks)
        diff = (relaxed(idx)[0] - full(idx)[0]).abs().max().item()
        assert diff <= atol, (arch, init, tying, diff)


def test_an_attention_narrower_than_the_model_does_not_cap_the_other_linears_rank():
    """Gemma-3-1B's attention is 4 x 256 = 1024 wide on a 1152-wide model: attn.proj (d x 1024), W^Q and the
    narrower W^K, W^V take their own full ranks while the MLP's go to theirs, so the widest matrix's rank is exact
    (it used to be refused, and the narrow matrices' rank left the rest short)."""
    full = source("gemma3", n_head=4, head_dim=6)  # attention 24 wide on d_model 32, keys/values 12
    relaxed = vanilla_to_recursive(full, loops=2, init="average", lora_rank=FULL_RANK)
    ranks = {name.removeprefix("body.blocks.0."): m.ranks for name, m in relaxed.named_modules()
             if name.startswith("body.blocks.0.") and hasattr(m, "lora_A")}
    assert ranks["attn.proj"] == (24,) and ranks["attn.qkv"] == (24, 12, 12) and ranks["mlp.proj"] == (FULL_RANK,)
    idx = tokens()
    assert (relaxed(idx)[0] - full(idx)[0]).abs().max().item() <= 1e-9
    with pytest.raises(BlockloopError, match=r"the largest min\(in, out\) is 32 \(mlp.gate 48x32, mlp.up 48x32, mlp.proj 32x48: full rank\)"):
        vanilla_to_recursive(full, loops=2, init="average", lora_rank=FULL_RANK + 1)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tied_norms_leave_a_gap_no_rank_closes(arch):
    full = source(arch)
    idx = tokens()
    tied = vanilla_to_recursive(full, loops=2, init="average", lora_rank=FULL_RANK, loop_norms=False)
    assert (tied(idx)[0] - full(idx)[0]).abs().max() > 1e-2
    assert not any(isinstance(m, LoopNorm) for m in tied.modules())


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("calibrated", [False, True])
def test_loss_does_not_increase_with_the_rank(arch, calibrated):
    """The loss: KL from the full model's next-token distributions on fixed data (0 for the full model). Ranks
    of a few channels (2-8 of 32) can start slightly worse than no LoRA on these random models, and neighbouring
    ranks need not improve (12 -> 16 can be slightly worse); ranks 0 < 12 < 24 < 32 improve each time."""
    full = source(arch)
    idx = tokens(batch=4, length=24)
    calibration = tokens(batch=4, length=24, seed=7) if calibrated else None
    with torch.no_grad():
        target = full(idx)[0].log_softmax(-1)
        losses = []
        for rank in (0, 12, 24, FULL_RANK):
            model = vanilla_to_recursive(full, loops=2, init="average", lora_rank=rank, calibration=calibration)
            log_q = model(idx)[0].log_softmax(-1)
            losses.append((target.exp() * (target - log_q)).sum(-1).mean().item())
    assert all(a >= b for a, b in itertools.pairwise(losses)), losses
    assert losses[0] > 1e-3 and losses[-1] < 1e-12


def test_per_loop_norms_start_from_the_replaced_layers_and_cost_a_gain_per_loop():
    full = source("gemma3")
    relaxed = vanilla_to_recursive(full, loops=2, init="average")
    norm = relaxed.body.blocks[1].attn.q_norm  # shared layer 1 replaces full layers 1 and 3 (cycle)
    assert torch.equal(norm.weight[0], full.body.blocks[1].attn.q_norm.weight)
    assert torch.equal(norm.weight[1], full.body.blocks[3].attn.q_norm.weight)
    tied = vanilla_to_recursive(full, loops=2, init="average", loop_norms=False)
    # 4 norms of d_model and 2 of head_dim per shared layer, one more copy each for the second loop
    assert relaxed.num_parameters() - tied.num_parameters() == 2 * (4 * 32 + 2 * 8)


@pytest.mark.parametrize("arch", ["neox", "gemma3"])
def test_per_loop_norms_decode_like_the_full_forward_sequence_and_depth_wise(arch):
    model = vanilla_to_recursive(source(arch), loops=2, init="average", lora_rank=4)
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    loops = torch.tensor([1, 0, 1])
    batched = model.run_loop(x, loops, model.loop_inputs(x))  # rows at their own loops: gains gathered per row
    for row, loop in enumerate(loops.tolist()):
        alone = model.run_loop(x[row : row + 1], loop, model.loop_inputs(x[row : row + 1]))
        torch.testing.assert_close(batched[row : row + 1], alone, atol=1e-12, rtol=1e-12)
    prompts, new = [tokens(1, 5, seed=3)[0].tolist(), tokens(1, 9, seed=4)[0].tolist()], 6
    reference = greedy_reference(model, prompts, new)
    assert generate(model, prompts, new, temperature=0.0) == reference  # the engine, sequence-wise
    engine = Engine(runner_for(model, exit_rule=ExitRule("none")), 2)
    requests = [engine.submit(p, new, sampling=SamplingParams(temperature=0.0)) for p in prompts]
    engine.run()
    assert [r.output for r in requests] == reference  # depth-wise


def greedy_reference(model, prompts, new):
    """Greedy continuations from the uncached forward, one token at a time."""
    out = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(new):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1, :97].argmax()))
        out.append(seq[len(prompt):])
    return out


MIXES = {  # 6 layers with a sliding window of 4, local except where global
    "agree": (3, [0, 2, 4], [0], []),  # 3 loops over 2 shared layers: layer 1 is global at depths 1, 3, 5
    "disagree": (2, [0, 1, 2, 3, 4], [], [0, 1, 2, 3, 4]),  # 2 loops: layer 2 is local at depth 2, global at 5
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_local_global_mixes_convert_exactly_and_decode_alike(mix):
    loops, local, shared_local, local_depths = MIXES[mix]
    full = source("gemma3", torch.float32, n_layer=6, sliding_window=4, local_layers=local, local_rope_base=1000.0)
    model = vanilla_to_recursive(full, loops=loops, init="average", lora_rank=FULL_RANK)
    assert (model.config.local_layers, model.config.local_depths) == (shared_local, local_depths)
    idx = tokens(length=20)
    assert (model(idx)[0] - full(idx)[0]).abs().max() <= 1e-4  # each depth position attends as it did
    prompts, new = [tokens(1, n, seed=n)[0].tolist() for n in (7, 3, 5)], 8
    reference = greedy_reference(model, prompts, new)
    assert generate(model, prompts, new, temperature=0.0) == reference  # cached = uncached
    engine = Engine(runner_for(model, exit_rule=ExitRule("none")), 2)  # the third joins rows at other loops
    requests = [engine.submit(p, new, sampling=SamplingParams(temperature=0.0)) for p in prompts]
    engine.run()
    assert [r.output for r in requests] == reference  # depth-wise = sequence-wise


def test_calibrated_svd_is_the_best_fit_on_inputs_of_the_measured_scale():
    full = source("gemma3")
    calibration = tokens(batch=4, length=24, seed=7)
    scales = input_scales(full, calibration)
    model = vanilla_to_recursive(full, loops=2, init="average", lora_rank=4, calibration=calibration)
    up = model.body.blocks[1].mlp.up  # loop 1 of shared layer 1 relaxes it towards full layer 3
    scale = scales[(3, "mlp.up")]
    residual = (full.body.blocks[3].mlp.up.weight - up.weight) * scale
    error = residual - up.scaling * up.lora_B[1] @ up.lora_A[1] * scale
    best = torch.linalg.svdvals(residual)[4:].pow(2).sum().sqrt()  # Eckart-Young on E diag(s)
    torch.testing.assert_close(error.norm(), best, atol=1e-10, rtol=1e-8)
    assert scale.shape == (32,) and scale.min() > 0 and scale.std() > 0
    # read a few windows at a time (thousands in one forward held every activation at once), the same scales
    for key, value in input_scales(full, calibration, batch_size=3).items():
        torch.testing.assert_close(value, scales[key], atol=0, rtol=1e-12)
    one_pass = {}
    hooks = [linear.register_forward_hook(lambda m, i, o, key=(p, n): one_pass.__setitem__(key, i[0].double().flatten(0, -2)))
             for p, block in enumerate(full.body.blocks) for n, linear in block.named_modules()
             if isinstance(linear, torch.nn.Linear)]
    full(calibration)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(scales[(3, "mlp.up")], one_pass[(3, "mlp.up")].pow(2).mean(0).sqrt(), atol=0, rtol=1e-12)
