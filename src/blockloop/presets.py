"""Named model presets: the paper sizes and the tiny CPU sizes the tests and the demo use.

Sizes in names are non-embedding parameters, as in the Block Transformer paper's Table 3, whose vanilla
models use Pythia's architecture (parallel residual, 25% rotary, LayerNorm, GELU, untied embeddings,
vocabulary 50,304, context 2,048).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable

from blockloop.config import DecoderConfig
from blockloop.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    build: Callable[[], DecoderConfig]


PRESETS: dict[str, Preset] = {}


def register(name: str, description: str) -> Callable[[Callable[[], DecoderConfig]], Callable[[], DecoderConfig]]:
    def decorator(build: Callable[[], DecoderConfig]) -> Callable[[], DecoderConfig]:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} registered twice")
        PRESETS[name] = Preset(name, description, build)
        return build

    return decorator


def from_name(name: str, **overrides: Any) -> DecoderConfig:
    """The preset's config with ``overrides`` applied (e.g. ``vocab_size`` from the tokenizer)."""
    preset = PRESETS.get(name)
    if preset is None:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(f"unknown preset {name!r}; {hint}run `blockloop presets` to list them")
    config = preset.build()
    config.name = name
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
