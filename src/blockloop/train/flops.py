"""FLOPs and KV-cache memory per model family, and model FLOPs utilisation (MFU).

Two levels, side by side:

* :func:`paper_training_flops` / :func:`paper_kv_cache_bytes` are the closed forms of the
  double-decoder paper (appendix A.2 and A.1): multi-head attention, a 4d GELU MLP, no LM head, full
  (unmasked) T^2 attention and its 2/3 : 1/3 layer split baked in.
* :func:`training_flops` / :func:`kv_cache_bytes` count the same way for an actual config (its layer
  split, grouped-query heads, MLP type, the LM head): 6 FLOPs per weight per token for forward and
  backward (PaLM appendix B) plus 12 d T per layer for the attention score and value products. On the
  paper's shapes without a head they reduce exactly to the closed forms (tested).

Families differ as in section 3.2: the double decoder's generation layers have two extra projections
(the cross k', v') and, in the paper's "efficient implementation", one attention's worth of products
(our dense implementation computes two, which :func:`measured_forward_flops` shows); the
encoder-decoder runs its encoder over T_in and its decoder over T_out only, plus cross-attention.

A Block Transformer counts what each token really costs: the block decoder runs once per L_B tokens
over T / L_B blocks, the token decoder n_lead + L_B - 1 positions per block (:func:`block_flops_per_token`).

MFU divides achieved FLOP/s by the device's dense bf16 peak, known only for the GPUs listed here.
"""

from __future__ import annotations

import torch
from torch import nn

from blockloop.config import BlockTransformerConfig, DecoderConfig, ModelConfig
from blockloop.data.span_corruption import span_counts
from blockloop.errors import BlockloopError

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, SXM parts.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}
FAMILIES = ("decoder", "double_decoder", "encoder_decoder")


# ----------------------------------------------------------------- the paper's closed forms (appendix A)
def paper_training_flops(family: str, seq_len: int, d_model: int, n_layer: int, out_len: int | None = None) -> float:
    """Appendix A.2: training FLOPs of one sequence (T = T_in; T_out for the encoder-decoder)."""
    T, d, L = seq_len, d_model, n_layer
    if family == "decoder":
        return L * (72 * T * d**2 + 12 * T**2 * d)
    if family == "double_decoder":
        return L * (76 * T * d**2 + 12 * T**2 * d)
    if family == "encoder_decoder":
        if out_len is None:
            raise BlockloopError("the encoder-decoder formula needs the decoder length T_out (--out-len)")
        To = out_len
        return L * ((52 * T + 28 * To) * d**2 + (4 * To**2 + 4 * T * To + 8 * T**2) * d)
    raise BlockloopError(f"unknown family {family!r}; one of {FAMILIES}")


def paper_kv_cache_bytes(family: str, d_model: int, n_layer: int, n_dec_layer: int, in_len: int, out_len: int,
                         bytes_per_value: int = 2) -> int:
    """Appendix A.1: 2 d b L (T_in + T_out) for decoder-only, 2 d b L_dec (T_in + T_out) for two stacks."""
    layers = n_layer if family == "decoder" else n_dec_layer
    return 2 * d_model * bytes_per_value * layers * (in_len + out_len)


# -------------------------------------------------------------------------- config-exact counts
def _layer_weights(config: DecoderConfig) -> dict[str, int]:
    d, h, kv, dh, ff = config.d_model, config.n_head, config.n_kv_head, config.head_dim, config.d_ff
    return {
        "q_o": 2 * d * h * dh,
        "kv": 2 * d * kv * dh,
        "mlp": (2 if config.mlp == "gelu" else 3) * d * ff,
    }


def stack_layers(config: DecoderConfig) -> tuple[int, int]:
    """(layers that see the whole input, layers that generate): (L, L), (L_ctx, L_gen) or (L_enc, L_dec)."""
    if config.family == "double_decoder":
        return config.n_context_layer, config.n_generation_layer
    if config.family == "encoder_decoder":
        return config.n_encoder_layer, config.n_decoder_layer
    if config.family == "recursive":
        return config.depth, config.depth  # every loop computes (and caches) its own keys and values
    return config.n_layer, config.n_layer


def encoder_decoder_lengths(config: DecoderConfig, seq_len: int) -> tuple[int, int]:
    """(T_in, T_out) of a span-corrupted window of ``seq_len`` tokens."""
    noise, spans = span_counts(seq_len, config.corruption_rate, config.mean_span_length, config.n_sentinels)
    return seq_len - noise + spans, noise + spans


def training_flops(config: DecoderConfig, seq_len: int, out_len: int | None = None, *, lm_head: bool = True) -> float:
    """Training FLOPs of one window of ``seq_len`` tokens for ``config``'s family.

    For the encoder-decoder, ``seq_len`` is T_in and ``out_len`` T_out (default: the span-corruption
    lengths of a ``seq_len`` window).
    """
    if config.family == "recursive":  # the looped depth's FLOPs; LoRA/prefix relaxations are not counted
        return training_flops(config.stack(config.depth), seq_len, lm_head=lm_head)
    w = _layer_weights(config)
    layer = w["q_o"] + w["kv"] + w["mlp"]
    att = 12 * config.n_head * config.head_dim  # per layer, per query, per key
    head = config.d_model * config.padded_vocab_size if lm_head else 0
    T = seq_len
    if config.family == "decoder":
        return 6 * T * (config.n_layer * layer + head) + att * config.n_layer * T**2
    if config.family == "double_decoder":
        n_ctx, n_gen = stack_layers(config)
        weights = n_ctx * layer + n_gen * (layer + w["kv"]) + head
        return 6 * T * weights + att * (n_ctx + n_gen) * T**2
    if config.family == "encoder_decoder":
        n_enc, n_dec = stack_layers(config)
        if out_len is None:
            T, out_len = encoder_decoder_lengths(config, seq_len)
        To = out_len
        tokens = T * n_enc * layer + To * (n_dec * (layer + w["q_o"]) + head) + T * n_dec * w["kv"]
        return 6 * tokens + att * (n_enc * T**2 + n_dec * (To**2 + T * To))
    raise BlockloopError(f"no FLOP formula for family {config.family!r}")


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """What the trainer's MFU readout uses: FLOPs of a ``seq_len`` window divided by its tokens."""
    if isinstance(config, BlockTransformerConfig):
        return block_flops_per_token(config, seq_len)
    if config.family in ("staircase", "ladder"):
        return recurrent_flops_per_token(config, seq_len)
    return training_flops(config, seq_len) / seq_len


def _stack_flops(config: DecoderConfig, positions: int, keys: int) -> float:
    """Training FLOPs of ``positions`` tokens through a stack, each attending to ``keys`` keys."""
    weights = config.n_layer * sum(_layer_weights(config).values())
    return positions * (6 * weights + 12 * config.n_layer * config.n_head * config.head_dim * keys)


def recurrent_flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """Steady-state training FLOPs per token of the staircase family: the core once per pass.

    A Staircase token has S / C (or m) passes, each attending to a window of at most S keys plus the cache
    (upper bound: full windows); a Ladder token has n_steps passes over the segment and its memory
    (``seq_len`` tokens, of which at most M before the segment). Keys/values of states the model does not
    compute further are projected through the layer's fused q/k/v projection (the query is dropped): once
    per layer for a state entering the Cached Staircase's cache, and for the Transformer-XL memory once per
    layer application and segment, i.e. M / T times per token. The Feedback mix adds its weighted sum.
    """
    qkv = 6 * config.d_model * (config.n_head + 2 * config.n_kv_head) * config.head_dim
    if config.family == "staircase":
        passes, keys = config.passes, config.step_size + config.cache_tokens
        extra = config.n_layer * qkv if config.cache_after else 0
        extra += 6 * (config.n_layer + 1) * config.d_model if config.memory_mix else 0
    else:
        passes, keys = config.n_steps, seq_len + config.memory_len
        extra = passes * config.n_layer * qkv * min(config.memory_len, seq_len) / seq_len
    head = 6 * config.d_model * config.padded_vocab_size
    return passes * _stack_flops(config, 1, keys) + extra + head


def block_flops_per_token(config: BlockTransformerConfig, seq_len: int) -> float:
    """Steady-state training FLOPs per token of a Block Transformer (per block, divided by L_B)."""
    lb = config.block_len
    block, token = config.block_decoder_config(), config.token_decoder_config()
    per_block = _stack_flops(block, 1, seq_len // lb)
    if config.embedder == "lookup":
        per_block += 6 * lb * config.embed_dim * config.block_d_model if lb * config.embed_dim != config.block_d_model else 0
    else:
        width = lb + (config.n_cls if config.embedder == "cls" else 0)
        readout = (config.n_cls if config.embedder == "cls" else lb) * config.embed_dim
        per_block += _stack_flops(config.embedder_config(), width, width) + 6 * readout * config.block_d_model
    positions = config.n_lead + lb - 1
    per_block += 6 * config.block_d_model * token.d_model * (config.prefix_len if config.token_decoder == "prefix" else lb)
    per_block += _stack_flops(token, positions, positions)
    if config.token_decoder == "cross":
        w = _layer_weights(token)
        per_block += token.n_layer * (6 * positions * w["q_o"] + 6 * lb * w["kv"])
        per_block += positions * 12 * token.n_layer * token.n_head * token.head_dim * lb
    per_block += lb * 6 * token.d_model * config.padded_vocab_size
    return per_block / lb


def kv_cache_bytes(config: DecoderConfig, prompt_len: int, new_tokens: int, bytes_per_value: int = 2) -> int:
    """Keys and values held while generating ``new_tokens`` after a ``prompt_len`` prompt (appendix A.1,
    with the config's own K/V heads): every layer for decoder-only, the generation/decoder layers only
    (self K/V of the generated tokens + cross K/V of the prompt) for the two-stack families."""
    per_token = 2 * config.n_kv_head * config.head_dim * bytes_per_value
    return per_token * stack_layers(config)[1] * (prompt_len + new_tokens)


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
