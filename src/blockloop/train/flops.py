"""Training FLOPs per token and model FLOPs utilisation (MFU).

FLOPs per token follow the PaLM appendix B accounting: 6 N for the forward and backward of every
weight matrix (embedding lookups excluded, the LM head included) plus 12 L H d_head T for the attention
score and value products at sequence length T. MFU divides achieved FLOP/s by the device's dense bf16
peak, which is only known for the data-centre GPUs listed here.
"""

from __future__ import annotations

import torch

from blockloop.config import DecoderConfig

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, SXM parts.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def matmul_parameters(config: DecoderConfig) -> int:
    """Weights that take part in a matrix multiply per token: all blocks plus the LM head."""
    d, h, kv, dh, ff = config.d_model, config.n_head, config.n_kv_head, config.head_dim, config.d_ff
    attn = d * (h + 2 * kv) * dh + h * dh * d
    mlp = (2 if config.mlp == "gelu" else 3) * d * ff
    return config.n_layer * (attn + mlp) + d * config.padded_vocab_size


def training_flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    attention = 12 * config.n_layer * config.n_head * config.head_dim * seq_len
    return 6 * matmul_parameters(config) + attention


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(flops_per_s: float, device: torch.device) -> float | None:
    """Fraction of the device's bf16 peak, or None where the peak is unknown (e.g. CPU)."""
    peak = peak_flops(device)
    return flops_per_s / peak if peak else None
