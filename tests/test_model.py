"""The vanilla decoder: configs, building blocks, tied weights, and cached = uncached."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from blockloop.config import DecoderConfig, save_config
from blockloop.errors import ConfigError
from blockloop.families import PRESETS, build_model, config_from_dict, from_name, load_config
from blockloop.nn.kv_cache import StepContext
from blockloop.nn.mlp import build_mlp
from blockloop.nn.norm import RMSNorm
from blockloop.nn.rope import apply_rope, rope_angles


def tiny_model(name: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(from_name(name, **overrides)).double().eval()


# ------------------------------------------------------------------ configs
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=100, n_head=3), "does not divide d_model"),
        (dict(n_head=4, n_kv_head=3, d_model=64), "must divide n_head"),
        (dict(norm="batchnorm"), "norm='batchnorm'"),
        (dict(mlp="relu2"), "mlp='relu2'"),
        (dict(rotary_pct=1.5), "rotary_pct"),
        (dict(n_layer=0), "n_layer"),
    ],
)
def test_impossible_configs_fail_with_a_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DecoderConfig(**kwargs)


def test_config_json_round_trip_and_unknown_fields(tmp_path):
    config = from_name("tiny-neox")
    save_config(config, tmp_path / "config.json")
    assert load_config(tmp_path / "config.json") == config
    data = json.loads((tmp_path / "config.json").read_text())
    data["n_layers"] = 3
    with pytest.raises(ConfigError, match="n_layers"):
        config_from_dict(data)


def test_unknown_preset_suggests_close_names():
    with pytest.raises(ConfigError, match="pythia-85m"):
        from_name("pythia-85")


@pytest.mark.parametrize(
    "name, non_embedding",
    [("pythia-5m", 4.7e6), ("pythia-19m", 18.9e6), ("pythia-85m", 85.0e6), ("pythia-302m", 302.3e6)],
)
def test_pythia_presets_have_the_papers_non_embedding_sizes(name, non_embedding):
    with torch.device("meta"):
        model = build_model(from_name(name))
    assert model.num_parameters(non_embedding=True) == pytest.approx(non_embedding, rel=0.01)


def test_every_preset_builds():
    for name in PRESETS:
        with torch.device("meta"):
            build_model(from_name(name))


# ----------------------------------------------------------- building blocks
def test_partial_rotary_leaves_the_tail_untouched_and_preserves_norms():
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    cos, sin = rope_angles(torch.arange(5), rotary_dim=4, base=10000.0)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., 4:], x[..., 4:])
    torch.testing.assert_close(y[..., :4].norm(dim=-1), x[..., :4].norm(dim=-1))
    assert torch.equal(y[:, :, 0], x[:, :, 0])  # position 0 is the identity rotation


def test_rope_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 8, generator=g, dtype=torch.float64)

    def score(pq, pk):
        cq, sq = rope_angles(torch.tensor([pq]), 8, 10000.0)
        ck, sk = rope_angles(torch.tensor([pk]), 8, 10000.0)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    # Angles are float32, so equal up to float32 rounding of position * frequency.
    torch.testing.assert_close(score(7, 3), score(104, 100), atol=1e-5, rtol=1e-5)
    assert abs(score(7, 3) - score(7, 4)) > 1e-3


def test_rmsnorm_formula():
    norm = RMSNorm(6, eps=1e-6)
    norm.weight.data = torch.arange(1.0, 7.0)
    x = torch.randn(3, 6)
    want = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), want)


@pytest.mark.parametrize("kind", ["gelu", "swiglu", "geglu"])
def test_mlp_formulas(kind):
    torch.manual_seed(0)
    mlp = build_mlp(kind, 8, 16, bias=True)
    x = torch.randn(4, 8)
    if kind == "gelu":
        want = mlp.proj(F.gelu(mlp.fc(x)))
    else:
        act = F.silu if kind == "swiglu" else (lambda t: F.gelu(t, approximate="tanh"))
        want = mlp.proj(act(mlp.gate(x)) * mlp.up(x))
    torch.testing.assert_close(mlp(x), want)


def test_parallel_residual_is_what_the_block_computes():
    model = tiny_model("tiny-neox")
    block = model.body.blocks[0]
    x = torch.randn(2, 6, 64, dtype=torch.float64)
    cos, sin = rope_angles(torch.arange(6), model.config.rotary_dim, model.config.rope_base)
    want = x + block.attn(block.norm1(x), cos, sin) + block.mlp(block.norm2(x))
    torch.testing.assert_close(block(x, cos, sin), want)


# ---------------------------------------------------------------- the model
@pytest.mark.parametrize("embedder", ["lookup", "encoder"])
def test_only_residual_output_projections_start_scaled_down(embedder):
    """GPT-2's init: attention, cross-attention and MLP output projections at std / sqrt(2 n_layer), every other
    matrix (a block embedder's input projection among them) at std."""
    torch.manual_seed(0)
    config = from_name("tiny-block", embedder=embedder, embed_dim=64, token_decoder="cross", init_std=0.02,
                       block_n_layer=4, token_n_layer=4)
    model = build_model(config)
    stds = {name: module.weight.std().item() for name, module in model.named_modules()
            if name.endswith("proj") and hasattr(module, "weight")}
    assert "embedder.proj" in stds and any(name.endswith(".cross.proj") for name in stds)
    for name, std in stds.items():  # scaled: 0.02 / sqrt(2 x 8 layers) = 0.005
        scaled = name.endswith((".attn.proj", ".cross.proj", ".mlp.proj"))
        assert (std < 0.015) == scaled, (name, std)


def test_tied_embeddings_share_storage_and_untied_do_not():
    tied = build_model(from_name("tiny"))
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()
    assert tied.num_parameters() == sum(p.numel() for p in tied.parameters())
    untied = build_model(from_name("tiny-neox"))
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()
    # A step on the tied model moves the head and the embedding together.
    opt = torch.optim.SGD(tied.parameters(), lr=1.0)
    idx = torch.randint(0, 258, (2, 8))
    tied(idx, idx)[1].backward()
    opt.step()
    assert torch.equal(tied.lm_head.weight, tied.embed.weight)


def test_loss_is_cross_entropy_and_ignores_minus_100():
    model = tiny_model("tiny")
    idx = torch.randint(0, 258, (2, 10))
    targets = torch.randint(0, 258, (2, 10))
    targets[0, :4] = -100
    logits, loss = model(idx, targets)
    keep = targets != -100
    want = F.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(loss, want)


@pytest.mark.parametrize("name", ["tiny", "tiny-neox"])
def test_cached_prefill_and_decode_equal_the_full_forward(name):
    model = tiny_model(name)
    idx = torch.randint(0, 258, (3, 24))
    full, _ = model(idx)
    cache = model.allocate_cache(3, 32)
    pieces = [model(idx[:, :10], step=StepContext(cache, torch.arange(10)))[0]]
    pieces.append(model(idx[:, 10:17], step=StepContext(cache, torch.arange(10, 17)))[0])  # chunked prefill
    for t in range(17, 24):
        pieces.append(model(idx[:, t : t + 1], step=StepContext(cache, torch.tensor([t])))[0])
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-10, rtol=1e-10)


def test_left_padding_does_not_change_a_rows_logits():
    model = tiny_model("tiny")
    prompt = torch.randint(0, 258, (1, 7))
    alone, _ = model(prompt)
    padded = torch.cat([torch.full((1, 5), 3), prompt], 1)
    valid = torch.arange(12)[None] >= 5
    positions = (torch.arange(12) - 5).clamp_min(0)[None]
    cache = model.allocate_cache(1, 12)
    logits, _ = model(padded, step=StepContext(cache, torch.arange(12), positions, valid))
    torch.testing.assert_close(logits[:, 5:], alone, atol=1e-10, rtol=1e-10)


def test_context_limits_are_enforced():
    model = tiny_model("tiny")
    with pytest.raises(ValueError, match="exceeds the model context"):
        model(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the model context"):
        model.allocate_cache(1, 129)


def test_dropout_is_active_in_training_only():
    model = build_model(from_name("tiny", dropout=0.5))
    idx = torch.randint(0, 258, (2, 16))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_cached_decode_matches_the_full_forward():
    torch.manual_seed(0)
    model = build_model(from_name("tiny-neox")).cuda().bfloat16().eval()
    idx = torch.randint(0, 258, (4, 40), device="cuda")
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.allocate_cache(4, 40)
        pieces = [model(idx[:, :32], step=StepContext(cache, torch.arange(32, device="cuda")))[0]]
        for t in range(32, 40):
            pieces.append(model(idx[:, t : t + 1], step=StepContext(cache, torch.tensor([t], device="cuda")))[0])
    cached = torch.cat(pieces, 1).float()
    assert ((cached - full.float()).norm() / full.float().norm()).item() < 2e-2


def test_model_files_saved_into_a_new_folder_load_back_exactly(tmp_path):
    """The library's save (README, Library) makes its folder, as torch.save's callers and save_pretrained expect."""
    from blockloop.train.checkpoint import load_checkpoint_config, load_model_state, save_model_files

    model = build_model(from_name("tiny"))
    folder = tmp_path / "not" / "yet"
    save_model_files(folder, model, model.config)
    copy = build_model(load_checkpoint_config(folder))
    load_model_state(folder, copy)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), copy.state_dict().values()))
