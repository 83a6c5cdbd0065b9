"""The shared pieces of every family's cost formulas: weights per layer, FLOPs of a stack, KV and weight bytes.

Each family's own formulas live in its module under :mod:`blockloop.families` and are reached through its
spec (``spec_of(config).training_flops_per_token(config, seq_len)``, ``.kv_bytes``, the double-decoder
paper's closed forms ``.paper_training_flops`` / ``.paper_kv_bytes``). They count the same way, with the
pieces here: 6 FLOPs per weight per token for forward and backward (PaLM appendix B) plus 12 d T per layer
for the attention score and value products (:func:`layer_weights`, :func:`stack_flops`).
"""

from __future__ import annotations

from torch import nn

from blockloop.config import DecoderConfig

GATED_MLPS = ("swiglu", "geglu")  # three matrices (gate, up, down); gelu and gelu_tanh have two


def layer_weights(config: DecoderConfig) -> dict[str, int]:
    """Weights of one layer: query + output projections, key + value projections, the MLP."""
    d, h, kv, dh, ff = config.d_model, config.n_head, config.n_kv_head, config.head_dim, config.d_ff
    return {
        "q_o": 2 * d * h * dh,
        "kv": 2 * d * kv * dh,
        "mlp": (3 if config.mlp in GATED_MLPS else 2) * d * ff,  # gated: gate, up, down; else fc, proj
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


def windowed_kv_cache_bytes(config: DecoderConfig, layers: int, rolling: int, tokens: int, bytes_per_value: int = 2) -> int:
    """As :func:`kv_cache_bytes`, ``rolling`` of the ``layers`` being sliding-window layers that keep only the last
    ``sliding_window`` tokens (their rolling cache)."""
    window = min(tokens, config.sliding_window or tokens)
    return (kv_cache_bytes(config, layers - rolling, tokens, bytes_per_value)
            + kv_cache_bytes(config, rolling, window, bytes_per_value))


def paper_kv_cache_bytes(d_model: int, layers: int, in_len: int, out_len: int, bytes_per_value: int = 2) -> int:
    """Appendix A.1 of the double-decoder paper: 2 d b L (T_in + T_out), L the layers that keep a cache."""
    return 2 * d_model * bytes_per_value * layers * (in_len + out_len)


def paper_kv_bytes_of_decoder_layers(d_model: int, n_layer: int, n_dec_layer: int, in_len: int, out_len: int,
                                     bytes_per_value: int = 2) -> int:
    """Appendix A.1 for the two-stack models: only the ``n_dec_layer`` layers that generate keep K/V (cross K/V
    of the input, self K/V of the output) -- the double decoder's generation layers, the encoder-decoder's
    decoder. ``n_layer`` is in the signature every family's ``paper_kv_bytes`` shares; it does not count."""
    return paper_kv_cache_bytes(d_model, n_dec_layer, in_len, out_len, bytes_per_value)


def param_bytes(*modules: nn.Module) -> int:
    """Bytes of the unique parameters of ``modules`` (a tied weight once)."""
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())
