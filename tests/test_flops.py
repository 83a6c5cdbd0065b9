"""Training-FLOP formulas against the FLOPs torch actually counts for our modules."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from blockloop.models import build_model
from blockloop.presets import from_name
from blockloop.train.flops import training_flops_per_token


def measured_forward_flops_per_token(model, length: int) -> float:
    idx = torch.randint(0, 258, (2, length))
    # The math SDPA backend decomposes attention into matmuls the counter sees (the fused CPU kernel is not counted).
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(idx)
    return counter.get_total_flops() / idx.numel()


@pytest.mark.parametrize("name", ["tiny", "tiny-neox"])
def test_decoder_formula_is_three_forward_passes_exactly(name):
    model = build_model(from_name(name))
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
