"""Llama (SmolLM2, Llama 1/2), Mistral, Qwen2 and Gemma (1): one weight layout.

Mistral is Llama without biases whose every layer may attend within a sliding window (``sliding_window``; null:
every layer global, exactly a Llama). Qwen2 is Llama with biases on q, k and v only (``qkv_bias``) and, where
``use_sliding_window`` is set, the layers ``layer_types`` names sliding. Gemma is Llama's layout with GeGLU, RMSNorm scaling by (1 + weight),
embeddings times sqrt(d) and an explicit head_dim; the weight names are the same.
"""

from __future__ import annotations

from typing import Any

from blockloop.config import DecoderConfig
from blockloop.convert.hf_archs.base import Architecture, common_fields, hf_common_fields, require, rope_theta
from blockloop.convert.keymap import FUSE_QKV, KeyMap, rule


def _biased(c: DecoderConfig) -> bool:
    return c.bias


def _qkv_biased(c: DecoderConfig) -> bool:
    return bool(c.qkv_bias)


def _untied(c: DecoderConfig) -> bool:
    return not c.tie_embeddings


L = "model.layers.{}."
LLAMA_KEYS = KeyMap(
    rule("embed.weight", "model.embed_tokens.weight"),
    rule("body.blocks.{}.norm1.weight", L + "input_layernorm.weight"),
    rule("body.blocks.{}.attn.qkv.weight", *(L + f"self_attn.{p}_proj.weight" for p in "qkv"), transform=FUSE_QKV),
    rule("body.blocks.{}.attn.qkv.bias", *(L + f"self_attn.{p}_proj.bias" for p in "qkv"), transform=FUSE_QKV, when=_qkv_biased),
    rule("body.blocks.{}.attn.proj.weight", L + "self_attn.o_proj.weight"),
    rule("body.blocks.{}.attn.proj.bias", L + "self_attn.o_proj.bias", when=_biased),
    rule("body.blocks.{}.norm2.weight", L + "post_attention_layernorm.weight"),
    *(rule(f"body.blocks.{{}}.mlp.{ours}.weight", L + f"mlp.{theirs}_proj.weight")
      for ours, theirs in (("gate", "gate"), ("up", "up"), ("proj", "down"))),
    *(rule(f"body.blocks.{{}}.mlp.{ours}.bias", L + f"mlp.{theirs}_proj.bias", when=_biased)
      for ours, theirs in (("gate", "gate"), ("up", "up"), ("proj", "down"))),
    rule("norm.weight", "model.norm.weight"),
    rule("lm_head.weight", "lm_head.weight", when=_untied),
)


def llama_config(hf: Any, name: str) -> DecoderConfig:
    require(hf.hidden_act == "silu", hf, f"hidden_act={hf.hidden_act!r} (Llama converts with silu, i.e. SwiGLU)")
    require(hf.attention_bias == hf.mlp_bias, hf, "attention_bias differs from mlp_bias")
    return DecoderConfig(
        **common_fields(hf, name), n_kv_head=hf.num_key_value_heads, head_dim=hf.head_dim, norm="rmsnorm",
        norm_eps=hf.rms_norm_eps, mlp="swiglu", bias=bool(hf.attention_bias), rope_base=rope_theta(hf),
    )


def llama_hf_config(c: DecoderConfig) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **hf_common_fields(c), num_key_value_heads=c.n_kv_head, head_dim=c.head_dim, rms_norm_eps=c.norm_eps,
        hidden_act="silu", attention_bias=c.bias, mlp_bias=c.bias,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
    )


def mistral_config(hf: Any, name: str) -> DecoderConfig:
    require(hf.hidden_act == "silu", hf, f"hidden_act={hf.hidden_act!r} (Mistral converts with silu, i.e. SwiGLU)")
    window = hf.sliding_window
    return DecoderConfig(
        **common_fields(hf, name), n_kv_head=hf.num_key_value_heads, head_dim=hf.head_dim, norm="rmsnorm",
        norm_eps=hf.rms_norm_eps, mlp="swiglu", bias=False, rope_base=rope_theta(hf),
        local_layers=list(range(hf.num_hidden_layers)) if window else [], sliding_window=window or None,
    )


def mistral_hf_config(c: DecoderConfig) -> Any:
    """Every layer local or none: a window on some layers only is no Mistral (the round trip says so)."""
    from transformers import MistralConfig

    return MistralConfig(
        **hf_common_fields(c), num_key_value_heads=c.n_kv_head, head_dim=c.head_dim, rms_norm_eps=c.norm_eps,
        hidden_act="silu", sliding_window=c.sliding_window if c.local_layers else None,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
    )


def qwen2_config(hf: Any, name: str) -> DecoderConfig:
    require(hf.hidden_act == "silu", hf, f"hidden_act={hf.hidden_act!r} (Qwen2 converts with silu, i.e. SwiGLU)")
    local = [i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention"]
    return DecoderConfig(
        **common_fields(hf, name), n_kv_head=hf.num_key_value_heads, head_dim=hf.hidden_size // hf.num_attention_heads,
        norm="rmsnorm", norm_eps=hf.rms_norm_eps, mlp="swiglu", bias=False, qkv_bias=True, rope_base=rope_theta(hf),
        local_layers=local, sliding_window=hf.sliding_window if local else None,
    )


def qwen2_hf_config(c: DecoderConfig) -> Any:
    from transformers import Qwen2Config

    local = bool(c.local_layers)
    return Qwen2Config(
        **hf_common_fields(c), num_key_value_heads=c.n_kv_head, rms_norm_eps=c.norm_eps, hidden_act="silu",
        use_sliding_window=local, sliding_window=c.sliding_window if local else None,
        layer_types=["sliding_attention" if i in c.local_layers else "full_attention" for i in range(c.n_layer)],
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
    )


def gemma_config(hf: Any, name: str) -> DecoderConfig:
    require(hf.hidden_act in ("gelu_pytorch_tanh", "gelu_new"), hf, f"hidden_act={hf.hidden_act!r} (GeGLU uses tanh GELU)")
    require(not hf.attention_bias, hf, "attention biases")
    return DecoderConfig(
        **common_fields(hf, name), n_kv_head=hf.num_key_value_heads, head_dim=hf.head_dim, norm="rmsnorm1p",
        norm_eps=hf.rms_norm_eps, mlp="geglu", bias=False, rope_base=rope_theta(hf), embed_scale=True,
    )


def gemma_hf_config(c: DecoderConfig) -> Any:
    from transformers import GemmaConfig

    return GemmaConfig(
        **hf_common_fields(c), num_key_value_heads=c.n_kv_head, head_dim=c.head_dim, rms_norm_eps=c.norm_eps,
        hidden_act="gelu_pytorch_tanh", attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
    )


LLAMA = Architecture("llama", "LlamaForCausalLM", LLAMA_KEYS, llama_config, llama_hf_config)
GEMMA = Architecture("gemma", "GemmaForCausalLM", LLAMA_KEYS, gemma_config, gemma_hf_config)
MISTRAL = Architecture("mistral", "MistralForCausalLM", LLAMA_KEYS, mistral_config, mistral_hf_config)
QWEN2 = Architecture("qwen2", "Qwen2ForCausalLM", LLAMA_KEYS, qwen2_config, qwen2_hf_config)
