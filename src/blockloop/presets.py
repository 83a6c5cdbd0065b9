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

from blockloop.config import (
    BlockTransformerConfig,
    DecoderConfig,
    DoubleDecoderConfig,
    EncoderDecoderConfig,
    LadderConfig,
    ModelConfig,
    RecursiveConfig,
    StaircaseConfig,
)
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


def _llama_style(
    n_layer: int, d_model: int, n_head: int, n_kv_head: int, context_length: int, cls: type = DecoderConfig, **fields: Any
) -> DecoderConfig:
    """RMSNorm, SwiGLU, no biases, tied embeddings; byte-level vocabulary for CPU-sized runs."""
    return cls(
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
        **fields,
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


# ------------------------------------------------------------- double-decoder paper (Alexander et al. 2026)
# Section 4 and Table 1: tied embeddings, RoPE, head dim 64 (n_head = d / 64), Xavier-uniform init, 32k BPE,
# context 2048; 8 context / 4 generation layers (12 for decoder-only), 10/5 for the smallest models; the
# encoder-decoder loses decoder layers until its non-embedding parameters match. The paper gives parameter
# targets (6.25M-100M), not widths: ours are the multiples of 64 nearest the target in non-embedding
# parameters. A.2 counts two FF layers of 4d (16Td^2), so the MLP is the plain GELU one.
PAPER_SIZES = {"6m": (10, 5, 192), "25m": (8, 4, 384), "100m": (8, 4, 832)}


def _paper(cls: type[DecoderConfig], n_layer: int, d_model: int, **fields: int) -> DecoderConfig:
    return cls(
        vocab_size=32000, context_length=2048, n_layer=n_layer, n_head=d_model // 64, d_model=d_model,
        norm="rmsnorm", mlp="gelu", bias=False, tie_embeddings=True, init="xavier_uniform", **fields,
    )


def _register_paper_sizes() -> None:
    for size, (n_ctx, n_gen, d) in PAPER_SIZES.items():
        # Per layer (in d^2): decoder 12, encoder-decoder decoder layer 16 (+ cross-attention), so the
        # encoder-decoder keeps n_ctx encoder layers and round(12 n_gen / 16) decoder layers to match the
        # decoder-only model of n_ctx + n_gen layers (the double decoder's generation layers are 14: +2 d^2 each).
        n_dec_only = n_ctx + n_gen
        n_sed_dec = round(12 * n_gen / 16)
        builds = {
            f"paper-decoder-{size}": (f"decoder-only, {n_dec_only} layers, d={d}", lambda n=n_dec_only, d=d: _paper(DecoderConfig, n, d)),
            f"paper-double-{size}": (
                f"double decoder, {n_ctx} context / {n_gen} generation layers, d={d}",
                lambda a=n_ctx, b=n_gen, d=d: _paper(DoubleDecoderConfig, a + b, d, n_context_layer=a),
            ),
            f"paper-encdec-{size}": (
                f"encoder-decoder, {n_ctx} encoder / {n_sed_dec} decoder layers, d={d}, span corruption",
                lambda a=n_ctx, b=n_sed_dec, d=d: _paper(EncoderDecoderConfig, a + b, d, n_encoder_layer=a),
            ),
        }
        for name, (description, build) in builds.items():
            register(name, f"{description} (double-decoder paper, ~{size} non-embedding)")(build)


_register_paper_sizes()


@register("tiny-double", "3-layer double decoder (2 context + 1 generation) for CPU tests")
def _tiny_double() -> DecoderConfig:
    return _llama_style(3, 64, 4, 4, 128, DoubleDecoderConfig, n_context_layer=2, max_blocks=8)


@register("tiny-encdec", "3-layer encoder-decoder (2 encoder + 1 decoder) for CPU tests")
def _tiny_encdec() -> DecoderConfig:
    return _llama_style(3, 64, 4, 4, 128, EncoderDecoderConfig, n_encoder_layer=2)


@register("demo-double", "double decoder, 3 context + 1 generation layers, the CPU demo's size")
def _demo_double() -> DecoderConfig:
    return _llama_style(4, 128, 4, 4, 256, DoubleDecoderConfig, n_context_layer=3)


@register("demo-encdec", "encoder-decoder, 3 encoder + 1 decoder layers, the CPU demo's size")
def _demo_encdec() -> DecoderConfig:
    return _llama_style(4, 128, 4, 4, 256, EncoderDecoderConfig, n_encoder_layer=3)


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


# ------------------------------------------------ Recursive Transformers (Bae et al. 2024, section 2.2)
@register("tiny-recursive", "1 shared Llama-style layer looped twice (CYCLE) for CPU tests")
def _tiny_recursive() -> RecursiveConfig:
    return _llama_style(1, 64, 4, 2, 128, RecursiveConfig, loops=2)


@register("demo-recursive", "the demo's 4-layer depth as 2 shared layers looped twice (CYCLE): half the layer weights")
def _demo_recursive() -> RecursiveConfig:
    return _llama_style(2, 128, 4, 4, 256, RecursiveConfig, loops=2)


# ------------------------------------------------------------------ staircase paper (Ju et al. 2022)
# Table 5 (shared per task) and Table 6 (best configuration per model). Tasks: 4 layers, d=256, 4 heads,
# dropout 0.2, BPTT segments of 128; language models: 8 layers, 8 heads, dropout 0.3, segments of 256,
# d=1024 for Reddit / BASE Data (117M parameters, Table 2), d=512 for Enwik8 (Table 5). Every model of a
# task shares one core, so parameter counts match (Table 1). The paper's relative position embeddings
# are rotary here. context_length bounds a segment and a generation (and the global cache's reach).
_STAIRCASE_TASKS = {"randomwalk": {"n_layer": 4, "d_model": 256, "n_head": 4, "dropout": 0.2, "context_length": 512},
                    "algorithm": {"n_layer": 4, "d_model": 256, "n_head": 4, "dropout": 0.2, "context_length": 512}}
_STAIRCASE_LM = {"reddit": {"n_layer": 8, "d_model": 1024, "n_head": 8, "dropout": 0.3, "context_length": 512, "vocab_size": 50304},
                 "base": {"n_layer": 8, "d_model": 1024, "n_head": 8, "dropout": 0.3, "context_length": 512, "vocab_size": 50304},
                 "enwik8": {"n_layer": 8, "d_model": 512, "n_head": 8, "dropout": 0.3, "context_length": 512, "vocab_size": 258}}
# Table 6: (recurrent steps, step size S, forward size C) per model; Ladder: (steps, attention span).
# Feedback Transformer and Global Cached Staircase: the best rows of Tables 7, 8 and 10.
_TABLE6 = {
    "randomwalk": {"staircase": (8, 64, 8), "cached": (1, 256, 4), "ladder": (8, 512), "feedback": 64, "global_": (1, 512, 8)},
    "algorithm": {"staircase": (8, 64, 8), "cached": (1, 64, 4), "ladder": (2, 512), "feedback": 32, "global_": (1, 512, 8)},
    "reddit": {"staircase": (8, 256, 32), "cached": (1, 384, 128), "ladder": (8, 256), "feedback": 512},
    "base": {"staircase": (8, 256, 32), "cached": (1, 384, 128), "ladder": (8, 256), "feedback": 512},
    "enwik8": {"staircase": (4, 256, 64), "cached": (1, 260, 4), "ladder": (4, 256), "feedback": 256},
}


def _paper_core(cls: type, task: str, **fields: Any) -> ModelConfig:
    shape = {**_STAIRCASE_TASKS, **_STAIRCASE_LM}[task]
    return cls(**{"vocab_size": 64, "norm": "layernorm", "mlp": "gelu", "bias": True, "tie_embeddings": False,
                  **shape, **fields})


def _register_staircase_paper() -> None:
    for task, best in _TABLE6.items():
        _, S, C = best["staircase"]
        register(f"staircase-{task}", f"Staircase, S={S}, C={C} ({S // C} passes), {task} core (staircase Table 6)")(
            lambda t=task, S=S, C=C: _paper_core(StaircaseConfig, t, step_size=S, chunk_size=C))
        m, S, C = best["cached"]
        register(f"cached-staircase-{task}", f"Cached Staircase, m={m}, S={S}, C={C}, {task} core (Table 6)")(
            lambda t=task, m=m, S=S, C=C: _paper_core(StaircaseConfig, t, step_size=S, chunk_size=C, cache_after=m))
        steps, span = best["ladder"]
        register(f"ladder-{task}", f"Ladder, {steps} steps (ABAB), attention span {span}, {task} core (Table 6)")(
            lambda t=task, n=steps, M=span: _paper_core(LadderConfig, t, n_steps=n, memory_len=M))
        span = _paper_core(DecoderConfig, task).context_length // 2
        register(f"transformer-xl-{task}", f"Transformer-XL baseline (one step, memory {span}), {task} core")(
            lambda t=task, M=span: _paper_core(LadderConfig, t, n_steps=1, memory_len=M))
        S = best["feedback"]
        register(f"feedback-{task}", f"Feedback Transformer (C=1, memory mix, span {S - 1}), {task} core")(
            lambda t=task, S=S: _paper_core(StaircaseConfig, t, step_size=S, chunk_size=1, cache_after=1, memory_mix=True))
        if "global_" in best:
            m, S, C = best["global_"]
            register(f"global-staircase-{task}", f"Global Cached Staircase, m={m}, C={C}, {task} core (Tables 7-8)")(
                lambda t=task, m=m, S=S, C=C: _paper_core(StaircaseConfig, t, step_size=S, chunk_size=C, cache_after=m,
                                                          global_cache=True))
    register("universal-transformer-reddit", "Universal Transformer: one Reddit layer, 8 steps (Table 2)")(
        lambda: _paper_core(LadderConfig, "reddit", n_layer=1, n_steps=8))


_register_staircase_paper()


def _tiny_core(cls: type, n_layer: int = 2, **fields: Any) -> ModelConfig:
    return _llama_style(n_layer, 64, 4, 4, 128, cls, **fields)


@register("tiny-staircase", "Staircase, 2-layer core, C=4, S=12 (3 passes) for CPU tests")
def _tiny_staircase() -> ModelConfig:
    return _tiny_core(StaircaseConfig, chunk_size=4, step_size=12)


@register("tiny-cached-staircase", "Cached Staircase, 2-layer core, C=4, S=16, cached after 2 passes, for CPU tests")
def _tiny_cached_staircase() -> ModelConfig:
    return _tiny_core(StaircaseConfig, chunk_size=4, step_size=16, cache_after=2)


@register("tiny-global-staircase", "Global Cached Staircase, 2-layer core, C=4, cached after 1 pass, for CPU tests")
def _tiny_global_staircase() -> ModelConfig:
    return _tiny_core(StaircaseConfig, chunk_size=4, step_size=8, cache_after=1, global_cache=True)


@register("tiny-feedback", "Feedback Transformer, 2 layers, memory span 15, for CPU tests")
def _tiny_feedback() -> ModelConfig:
    return _tiny_core(StaircaseConfig, chunk_size=1, step_size=16, cache_after=1, memory_mix=True)


@register("tiny-ladder", "Ladder, 2-layer core x 2 steps (ABAB) for CPU tests")
def _tiny_ladder() -> ModelConfig:
    return _tiny_core(LadderConfig, n_steps=2)


@register("tiny-ladder-aabb", "Ladder, 2-layer core x 2 steps (AABB) for CPU tests")
def _tiny_ladder_aabb() -> ModelConfig:
    return _tiny_core(LadderConfig, n_steps=2, pattern="aabb")


@register("tiny-universal", "Universal Transformer: one layer x 4 steps, for CPU tests")
def _tiny_universal() -> ModelConfig:
    return _tiny_core(LadderConfig, n_layer=1, n_steps=4)


@register("tiny-transformer-xl", "Transformer-XL: 2 layers, memory (attention span) 16, for CPU tests")
def _tiny_transformer_xl() -> ModelConfig:
    return _tiny_core(LadderConfig, n_steps=1, memory_len=16)


@register("demo-staircase", "Staircase over the demo's 4-layer core, C=32, S=64 (2 passes)")
def _demo_staircase() -> ModelConfig:
    return _llama_style(4, 128, 4, 4, 256, StaircaseConfig, chunk_size=32, step_size=64)
