"""Training FLOPs per token and model FLOPs utilisation (MFU).

FLOPs per token follow the PaLM appendix B accounting: 6 N for the forward and backward of every
weight matrix a token passes through (embedding lookups excluded, the LM head included) plus
12 L H d_head T for the attention score and value products over T keys. Structured models count what
each token really costs: a Block Transformer's block decoder runs once per L_B tokens over T / L_B
blocks, and its token decoder runs n_lead + L_B - 1 positions per block. MFU divides achieved FLOP/s by
the device's dense bf16 peak, which is only known for the data-centre GPUs listed here.
"""

from __future__ import annotations

import torch

from blockloop.config import BlockTransformerConfig, DecoderConfig, ModelConfig

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, SXM parts.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def stack_matmul_parameters(config: DecoderConfig) -> int:
    """Weights in the matrix multiplies of one pass through a stack of ``config.n_layer`` blocks."""
    d, h, kv, dh, ff = config.d_model, config.n_head, config.n_kv_head, config.head_dim, config.d_ff
    attn = d * (h + 2 * kv) * dh + h * dh * d
    mlp = (2 if config.mlp == "gelu" else 3) * d * ff
    return config.n_layer * (attn + mlp)


def _attention_flops(config: DecoderConfig, keys: int) -> int:
    return 12 * config.n_layer * config.n_head * config.head_dim * keys


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    if isinstance(config, BlockTransformerConfig):
        return _block_flops_per_token(config, seq_len)
    head = config.d_model * config.padded_vocab_size
    return 6 * (stack_matmul_parameters(config) + head) + _attention_flops(config, seq_len)


def _block_flops_per_token(config: BlockTransformerConfig, seq_len: int) -> float:
    lb = config.block_len
    block, token = config.block_decoder_config(), config.token_decoder_config()
    per_block = 6 * stack_matmul_parameters(block) + _attention_flops(block, seq_len // lb)
    if config.embedder == "lookup":
        per_block += 6 * lb * config.embed_dim * config.block_d_model if lb * config.embed_dim != config.block_d_model else 0
    else:
        embedder = config.embedder_config()
        width = config.block_len + (config.n_cls if config.embedder == "cls" else 0)
        readout = (config.n_cls if config.embedder == "cls" else lb) * config.embed_dim
        per_block += width * (6 * stack_matmul_parameters(embedder) + _attention_flops(embedder, width))
        per_block += 6 * readout * config.block_d_model
    positions = config.n_lead + lb - 1
    per_block += 6 * config.block_d_model * config.token_decoder_config().d_model * (
        config.prefix_len if config.token_decoder == "prefix" else lb
    )
    per_block += positions * (6 * stack_matmul_parameters(token) + _attention_flops(token, positions))
    if config.token_decoder == "cross":
        d, dh, h, kv = token.d_model, token.head_dim, token.n_head, token.n_kv_head
        cross = token.n_layer * (d * h * dh + h * dh * d)
        per_block += positions * 6 * cross + lb * 6 * token.n_layer * d * 2 * kv * dh
        per_block += positions * _attention_flops(token, lb)
    per_block += lb * 6 * token.d_model * config.padded_vocab_size
    return per_block / lb


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(flops_per_s: float, device: torch.device) -> float | None:
    """Fraction of the device's bf16 peak, or None where the peak is unknown (e.g. CPU)."""
    peak = peak_flops(device)
    return flops_per_s / peak if peak else None
