"""Named model presets: the paper sizes and the tiny CPU sizes the tests and the demo use.

Sizes in names are non-embedding parameters, as in the Block Transformer paper's Table 3, whose vanilla
models use Pythia's architecture (parallel residual, 25% rotary, LayerNorm, GELU, untied embeddings,
vocabulary 50,304, context 2,048).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable

from blockloop.config import BlockTransformerConfig, DecoderConfig, ModelConfig
from blockloop.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    build: Callable[[], ModelConfig]


PRESETS: dict[str, Preset] = {}


def register(name: str, description: str) -> Callable[[Callable[[], ModelConfig]], Callable[[], ModelConfig]]:
    def decorator(build: Callable[[], ModelConfig]) -> Callable[[], ModelConfig]:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} registered twice")
        PRESETS[name] = Preset(name, description, build)
        return build

    return decorator


def from_name(name: str, **overrides: Any) -> ModelConfig:
    """The preset's config with ``overrides`` applied (e.g. ``vocab_size`` from the tokenizer)."""
    preset = PRESETS.get(name)
    if preset is None:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(f"unknown preset {name!r}; {hint}run `blockloop presets` to list them")
    config = preset.build()
    config.name = name
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"preset {name!r} ({config.family}) has no config field {', '.join(unknown)}")
    return config.replace(**overrides) if overrides else config


def _pythia(n_layer: int, d_model: int, n_head: int) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=50304,
        context_length=2048,
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        norm="layernorm",
        mlp="gelu",
        bias=True,
        rotary_pct=0.25,
        parallel_residual=True,
        tie_embeddings=False,
    )


@register("pythia-5m", "Pythia shape, 5M non-embedding (Block Transformer Table 3 vanilla)")
def _pythia_5m() -> DecoderConfig:
    return _pythia(6, 256, 8)


@register("pythia-19m", "Pythia shape, 19M non-embedding (Block Transformer Table 3 vanilla)")
def _pythia_19m() -> DecoderConfig:
    return _pythia(6, 512, 8)


@register("pythia-85m", "Pythia shape, 85M non-embedding (Block Transformer Table 3 vanilla)")
def _pythia_85m() -> DecoderConfig:
    return _pythia(12, 768, 12)


@register("pythia-302m", "Pythia shape, 302M non-embedding (Block Transformer Table 3 vanilla)")
def _pythia_302m() -> DecoderConfig:
    return _pythia(24, 1024, 16)


def _llama_style(n_layer: int, d_model: int, n_head: int, n_kv_head: int, context_length: int) -> DecoderConfig:
    """RMSNorm, SwiGLU, no biases, tied embeddings; byte-level vocabulary for CPU-sized runs."""
    return DecoderConfig(
        vocab_size=258,
        context_length=context_length,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv_head,
        d_model=d_model,
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tie_embeddings=True,
    )


@register("tiny", "2-layer Llama-style model (RMSNorm, SwiGLU, GQA, tied) for CPU tests")
def _tiny() -> DecoderConfig:
    return _llama_style(n_layer=2, d_model=64, n_head=4, n_kv_head=2, context_length=128)


@register("tiny-neox", "2-layer Pythia-style model (parallel residual, partial rotary, untied) for CPU tests")
def _tiny_neox() -> DecoderConfig:
    return _pythia(2, 64, 4).replace(vocab_size=258, padded_vocab_size=258, context_length=128)


@register("demo", "4-layer Llama-style model the CPU demo trains in a few minutes")
def _demo() -> DecoderConfig:
    return _llama_style(n_layer=4, d_model=128, n_head=4, n_kv_head=4, context_length=256)


def _block(token: tuple[int, int, int], block: tuple[int, int, int], **kwargs: object) -> BlockTransformerConfig:
    """A Block Transformer with Pythia-style layers; ``token``/``block`` are (layers, width, heads)."""
    return BlockTransformerConfig(
        vocab_size=50304, context_length=2048, block_len=4,
        token_n_layer=token[0], token_d_model=token[1], token_n_head=token[2],
        block_n_layer=block[0], block_d_model=block[1], block_n_head=block[2],
        norm="layernorm", mlp="gelu", bias=True, rotary_pct=0.25, parallel_residual=True, tie_embeddings=False,
        **kwargs,
    )


_TABLE3_BLOCK = {"5m": ((3, 256, 8), (3, 256, 8)), "19m": ((3, 512, 8), (3, 512, 8)), "85m": ((6, 768, 12), (6, 768, 12)),
                 "302m": ((12, 1024, 16), (12, 1024, 16)), "805m": ((8, 2048, 16), (8, 2048, 16)),
                 "1.2b": ((12, 2048, 16), (12, 2048, 16))}
_TABLE4_MEGABYTE = {"5m": ((4, 128, 4), (5, 256, 8)), "19m": ((4, 256, 8), (5, 512, 8)), "85m": ((4, 512, 8), (11, 768, 12))}

for _size, (_token, _blk) in _TABLE3_BLOCK.items():
    register(f"block-{_size}", f"Block Transformer, {_size.upper()} non-embedding, L_B=4, prefix 2 (Table 3)")(
        lambda t=_token, b=_blk: _block(t, b, token_decoder="prefix", prefix_len=2)
    )
for _size, (_token, _blk) in _TABLE4_MEGABYTE.items():
    register(f"megabyte-{_size}", f"MEGABYTE-style block model, {_size.upper()} non-embedding, summation (Table 4)")(
        lambda t=_token, b=_blk: _block(t, b, token_decoder="sum")
    )


def _llama_style_block(n_layer: int, d_model: int, n_head: int, context_length: int) -> BlockTransformerConfig:
    """Block decoder and token decoder of ``n_layer`` Llama-style layers each, byte vocabulary."""
    return BlockTransformerConfig(
        vocab_size=258, context_length=context_length, block_len=4, prefix_len=2,
        block_n_layer=n_layer, block_d_model=d_model, block_n_head=n_head,
        token_n_layer=n_layer, token_d_model=d_model, token_n_head=n_head,
        embedder_n_layer=1, norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=True,
    )


@register("tiny-block", "Block Transformer with 1+1 Llama-style layers (L_B=4, prefix 2) for CPU tests")
def _tiny_block() -> BlockTransformerConfig:
    return _llama_style_block(n_layer=1, d_model=64, n_head=4, context_length=128)


@register("demo-block", "Block Transformer with the demo's 4 layers split 2+2 (L_B=4, prefix 2)")
def _demo_block() -> BlockTransformerConfig:
    return _llama_style_block(n_layer=2, d_model=128, n_head=4, context_length=256)
