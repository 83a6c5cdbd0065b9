"""Gemma-3's text decoder (``Gemma3ForCausalLM``): Gemma plus q/k norms, sandwich norms around attention
and MLP, scores scaled by query_pre_attn_scalar^-1/2, and interleaved sliding-window (local) layers with
their own rotary base."""

from __future__ import annotations

from typing import Any

from blockloop.config import DecoderConfig
from blockloop.convert.hf_archs.base import Architecture, common_fields, hf_common_fields, require, rope_theta
from blockloop.convert.keymap import FUSE_QKV, KeyMap, rule

L = "model.layers.{}."
GEMMA3_KEYS = KeyMap(
    rule("embed.weight", "model.embed_tokens.weight"),
    rule("body.blocks.{}.norm1.weight", L + "input_layernorm.weight"),
    rule("body.blocks.{}.attn.qkv.weight", *(L + f"self_attn.{p}_proj.weight" for p in "qkv"), transform=FUSE_QKV),
    rule("body.blocks.{}.attn.q_norm.weight", L + "self_attn.q_norm.weight"),
    rule("body.blocks.{}.attn.k_norm.weight", L + "self_attn.k_norm.weight"),
    rule("body.blocks.{}.attn.proj.weight", L + "self_attn.o_proj.weight"),
    rule("body.blocks.{}.post_attn_norm.weight", L + "post_attention_layernorm.weight"),
    rule("body.blocks.{}.norm2.weight", L + "pre_feedforward_layernorm.weight"),
    rule("body.blocks.{}.post_mlp_norm.weight", L + "post_feedforward_layernorm.weight"),
    *(rule(f"body.blocks.{{}}.mlp.{ours}.weight", L + f"mlp.{theirs}_proj.weight")
      for ours, theirs in (("gate", "gate"), ("up", "up"), ("proj", "down"))),
    rule("norm.weight", "model.norm.weight"),
    rule("lm_head.weight", "lm_head.weight", when=lambda c: not c.tie_embeddings),
)


def gemma3_config(hf: Any, name: str) -> DecoderConfig:
    require(hf.hidden_activation in ("gelu_pytorch_tanh", "gelu_new"), hf, f"hidden_activation={hf.hidden_activation!r}")
    require(not hf.attention_bias, hf, "attention biases")
    require(hf.attn_logit_softcapping is None, hf, "attention-logit soft-capping")
    require(not getattr(hf, "use_bidirectional_attention", False), hf, "bidirectional attention (an encoder)")
    local = [i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention"]
    return DecoderConfig(
        **common_fields(hf, name), n_kv_head=hf.num_key_value_heads, head_dim=hf.head_dim, norm="rmsnorm1p",
        norm_eps=hf.rms_norm_eps, mlp="geglu", bias=False, embed_scale=True, qk_norm=True, sandwich_norm=True,
        attn_scalar=hf.query_pre_attn_scalar, rope_base=rope_theta(hf, "full_attention"),
        local_layers=local, sliding_window=hf.sliding_window if local else None,
        local_rope_base=rope_theta(hf, "sliding_attention") if local else None,
        logit_softcap=hf.final_logit_softcapping,
    )


def gemma3_hf_config(c: DecoderConfig) -> Any:
    from transformers import Gemma3TextConfig

    rope = {"rope_type": "default", "rope_theta": c.rope_base}
    local_rope = {"rope_type": "default", "rope_theta": c.local_rope_base or c.rope_base}
    return Gemma3TextConfig(
        **hf_common_fields(c), num_key_value_heads=c.n_kv_head, head_dim=c.head_dim, rms_norm_eps=c.norm_eps,
        hidden_activation="gelu_pytorch_tanh", attention_bias=False, query_pre_attn_scalar=_integral(c.attn_scalar or c.head_dim),
        sliding_window=c.sliding_window or c.context_length, final_logit_softcapping=c.logit_softcap,
        layer_types=["sliding_attention" if i in c.local_layers else "full_attention" for i in range(c.n_layer)],
        rope_parameters={"full_attention": rope, "sliding_attention": local_rope},
    )


GEMMA3 = Architecture("gemma3_text", "Gemma3ForCausalLM", GEMMA3_KEYS, gemma3_config, gemma3_hf_config)


def _integral(x: float) -> int | float:
    """Hugging Face types query_pre_attn_scalar as int; a fractional one stays float and is refused there."""
    return int(x) if float(x).is_integer() else x
