"""Training-FLOP formulas against the FLOPs torch actually counts for our modules."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from blockloop.families import build_model, from_name, spec_of


def training_flops_per_token(config, seq_len: int) -> float:
    return spec_of(config).training_flops_per_token(config, seq_len)


def measured_forward_flops_per_token(model, length: int) -> float:
    idx = torch.randint(0, 258, (2, length))
    # The math SDPA backend decomposes attention into matmuls the counter sees (the fused CPU kernel is not counted).
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(idx)
    return counter.get_total_flops() / idx.numel()


@pytest.mark.parametrize("name,overrides", [("tiny", {}), ("tiny-neox", {}), ("tiny-neox", {"mlp": "gelu_tanh"}),
                                            ("tiny", {"mlp": "geglu"})])
def test_decoder_formula_is_three_forward_passes_exactly(name, overrides):
    model = build_model(from_name(name, **overrides))
    formula = training_flops_per_token(model.config, 128)
    assert formula / 3 == pytest.approx(measured_forward_flops_per_token(model, 128), rel=1e-9)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"token_decoder": "sum"}, {"token_decoder": "cross"}, {"embedder": "encoder", "embed_dim": 32},
     {"embedder": "cls", "embed_dim": 32}],
)
def test_block_formula_matches_measured_flops(overrides):
    """The formula is the steady state; a training window skips the token decoder on its first block."""
    model = build_model(from_name("tiny-block", **overrides))
    ratio = training_flops_per_token(model.config, 128) / 3 / measured_forward_flops_per_token(model, 128)
    assert 1.0 < ratio < 1.0 + 1 / 32


def measured_segment_flops_per_token(model, length: int, carried: bool) -> float:
    """One forward of a segment, after a first segment's carried state when ``carried``."""
    idx = torch.randint(0, 258, (2, length))
    state = model(idx, return_state=True)[2] if carried else None
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(idx, state=state)
    return counter.get_total_flops() / idx.numel()


@pytest.mark.parametrize("name", ["tiny-ladder", "tiny-universal", "tiny-transformer-xl"])
def test_ladder_formula_is_three_forward_passes_of_a_segment_after_its_memory(name):
    """Steady state: Transformer-XL's memory is full (M keys before the segment, re-projected per segment)."""
    model = build_model(from_name(name)).eval()
    formula = training_flops_per_token(model.config, 64)
    assert formula / 3 == pytest.approx(measured_segment_flops_per_token(model, 64, carried=True), rel=1e-9)


@pytest.mark.parametrize("name", ["tiny-staircase", "tiny-cached-staircase", "tiny-global-staircase", "tiny-feedback"])
def test_staircase_formula_bounds_a_stream_from_empty(name):
    """Every pass and cache projection is counted exactly; attention is counted over full windows (S keys and
    a full cache), which a stream's first steps and a global cache that has not filled do not reach."""
    model = build_model(from_name(name)).eval()
    ratio = training_flops_per_token(model.config, 128) / 3 / measured_segment_flops_per_token(model, 128, carried=False)
    assert 1.0 <= ratio < 1.15  # the global cache of 128 states is half full on average over 128 tokens


@pytest.mark.parametrize("overrides", [{}, {"step_size": 64}, {"chunk_size": 8, "step_size": 64}])
def test_cached_staircase_formula_is_three_forward_passes_of_a_steady_step(overrides):
    """Cached after one pass, a chunk's tokens finish in the step that reads them: after a first segment that step
    attends over the full window, the chunk's C keys and a cache of S - C states, S keys in all (not S plus the cache)."""
    model = build_model(from_name("tiny-cached-staircase", cache_after=1, **overrides)).eval()
    C = model.config.chunk_size
    idx = torch.randint(0, 258, (2, 128))
    state = model(idx, return_state=True)[2]
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(idx[:, :C], state=state)
    step = counter.get_total_flops() / (2 * C)
    assert training_flops_per_token(model.config, 128) / 3 == pytest.approx(step, rel=1e-9)


@pytest.mark.parametrize("preset", ["tiny-staircase", "tiny-transformer-xl", "tiny-double"])
def test_the_generation_state_of_a_meta_model_counts_what_a_real_one_allocates(preset):
    """The flops report sizes the serving state on the meta device (no memory); every meta tensor counts, as the
    real tensors do, one per storage."""
    from blockloop.bench.reports import _generation_state_bytes

    with torch.device("meta"):
        meta = _generation_state_bytes(build_model(from_name(preset)), 64, 2)
    real = _generation_state_bytes(build_model(from_name(preset)), 64, 2)
    assert meta == real > 0


def test_the_bf16_peak_is_the_cards_own_form_factor(monkeypatch):
    """An H100 PCIe or NVL would have been taken for an SXM part (989 TFLOP/s), its MFU read low; an unknown card
    has no peak (no MFU, rather than a wrong one)."""
    from blockloop.train.flops import peak_flops

    cuda = torch.device("cuda")
    for name, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
                       ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                       ("NVIDIA GeForce RTX 4090", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(cuda) == peak, name
    assert peak_flops(torch.device("cpu")) is None
