"""GPT-2: learned absolute positions (no rotary), LayerNorm, tanh-GELU MLP, and ``Conv1D`` weights stored
(in, out), transposed on the way in and out."""

from __future__ import annotations

from typing import Any

from blockloop.config import DecoderConfig
from blockloop.convert.hf_archs.base import PLAIN_ACTIVATIONS, Architecture, require
from blockloop.convert.keymap import TRANSPOSE, KeyMap, rule

L = "transformer.h.{}."
GPT2_KEYS = KeyMap(
    rule("embed.weight", "transformer.wte.weight"),
    rule("pos_embed.weight", "transformer.wpe.weight"),
    *(rule(f"body.blocks.{{}}.{ours}.{p}", L + f"{theirs}.{p}")
      for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")) for p in ("weight", "bias")),
    *(rule(f"body.blocks.{{}}.{ours}.weight", L + f"{theirs}.weight", transform=TRANSPOSE)
      for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj"))),
    *(rule(f"body.blocks.{{}}.{ours}.bias", L + f"{theirs}.bias")
      for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj"))),
    rule("norm.weight", "transformer.ln_f.weight"),
    rule("norm.bias", "transformer.ln_f.bias"),
    rule("lm_head.weight", "lm_head.weight", when=lambda c: not c.tie_embeddings),
)


def gpt2_config(hf: Any, name: str) -> DecoderConfig:
    require(hf.activation_function in PLAIN_ACTIVATIONS, hf, f"activation_function={hf.activation_function!r}")
    require(hf.scale_attn_weights and not hf.scale_attn_by_inverse_layer_idx, hf, "non-standard attention scaling")
    return DecoderConfig(
        name=name, vocab_size=hf.vocab_size, context_length=hf.n_positions, tie_embeddings=bool(hf.tie_word_embeddings),
        n_layer=hf.n_layer, n_head=hf.n_head, d_model=hf.n_embd, d_ff=hf.n_inner or 4 * hf.n_embd, norm="layernorm",
        norm_eps=hf.layer_norm_epsilon, mlp=PLAIN_ACTIVATIONS[hf.activation_function], bias=True, rotary_pct=0.0,
        learned_positions=True,
    )


def gpt2_hf_config(c: DecoderConfig) -> Any:
    from transformers import GPT2Config

    act = {"gelu": "gelu", "gelu_tanh": "gelu_new"}.get(c.mlp, c.mlp)
    return GPT2Config(
        vocab_size=c.padded_vocab_size, n_positions=c.context_length, tie_word_embeddings=c.tie_embeddings,
        n_layer=c.n_layer, n_head=c.n_head, n_embd=c.d_model, n_inner=c.d_ff, layer_norm_epsilon=c.norm_eps,
        activation_function=act,
    )


GPT2 = Architecture("gpt2", "GPT2LMHeadModel", GPT2_KEYS, gpt2_config, gpt2_hf_config)
