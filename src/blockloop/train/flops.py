"""Counting helpers for FLOPs, KV-cache and weight bytes, and model FLOPs utilisation (MFU).

Each family's own formulas live in its module under :mod:`blockloop.families` and are reached through
its spec (``spec_of(config).training_flops_per_token(config, seq_len)``, ``.kv_bytes``, the double-decoder
paper's closed forms ``.paper_training_flops`` / ``.paper_kv_bytes``). They count the same way, with the
pieces here: 6 FLOPs per weight per token for forward and backward (PaLM appendix B) plus 12 d T per layer
for the attention score and value products (:func:`layer_weights`, :func:`stack_flops`).

MFU divides achieved FLOP/s by the device's dense bf16 peak, known only for the GPUs listed here.
"""

from __future__ import annotations

import torch
from torch import nn

from blockloop.config import DecoderConfig

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, SXM parts.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def layer_weights(config: DecoderConfig) -> dict[str, int]:
    """Weights of one layer: query + output projections, key + value projections, the MLP."""
    d, h, kv, dh, ff = config.d_model, config.n_head, config.n_kv_head, config.head_dim, config.d_ff
    return {
        "q_o": 2 * d * h * dh,
        "kv": 2 * d * kv * dh,
        "mlp": (2 if config.mlp == "gelu" else 3) * d * ff,
    }


def attention_flops(config: DecoderConfig) -> int:
    """Training FLOPs of the score and value products per layer, per query, per key."""
    return 12 * config.n_head * config.head_dim


def stack_flops(config: DecoderConfig, positions: int, keys: int) -> float:
    """Training FLOPs of ``positions`` tokens through a stack, each attending to ``keys`` keys."""
    weights = config.n_layer * sum(layer_weights(config).values())
    return positions * (6 * weights + config.n_layer * attention_flops(config) * keys)


def kv_cache_bytes(config: DecoderConfig, layers: int, tokens: int, bytes_per_value: int = 2) -> int:
    """Keys and values of ``tokens`` tokens in ``layers`` layers with the config's own K/V heads."""
    return 2 * config.n_kv_head * config.head_dim * bytes_per_value * layers * tokens


def paper_kv_cache_bytes(d_model: int, layers: int, in_len: int, out_len: int, bytes_per_value: int = 2) -> int:
    """Appendix A.1 of the double-decoder paper: 2 d b L (T_in + T_out), L the layers that keep a cache."""
    return 2 * d_model * bytes_per_value * layers * (in_len + out_len)


def param_bytes(*modules: nn.Module) -> int:
    """Bytes of the unique parameters of ``modules`` (a tied weight once)."""
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def measured_forward_flops(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """FLOPs of one forward on ``batch`` counted by torch's FlopCounterMode (matmuls and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**batch)
    return counter.get_total_flops()


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(flops_per_s: float, device: torch.device) -> float | None:
    """Fraction of the device's bf16 peak, or None where the peak is unknown (e.g. CPU)."""
    peak = peak_flops(device)
    return flops_per_s / peak if peak else None
