"""GPT-NeoX (Pythia): LayerNorm, plain GELU MLP, partial rotary, parallel (or sequential) residual, and
one qkv projection whose rows are grouped per head (regrouped by :data:`~blockloop.convert.keymap.NEOX_QKV`).

This is also the export target for blockloop's own LayerNorm/GELU decoders.
"""

from __future__ import annotations

from typing import Any

from blockloop.config import DecoderConfig
from blockloop.convert.hf_archs.base import (
    PLAIN_ACTIVATIONS,
    Architecture,
    common_fields,
    hf_common_fields,
    require,
    rope_theta,
)
from blockloop.convert.keymap import NEOX_QKV, KeyMap, rule

L = "gpt_neox.layers.{}."
NEOX_KEYS = KeyMap(
    rule("embed.weight", "gpt_neox.embed_in.weight"),
    *(rule(f"body.blocks.{{}}.{ours}.{p}", L + f"{theirs}.{p}")
      for ours, theirs in (("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm")) for p in ("weight", "bias")),
    rule("body.blocks.{}.attn.qkv.weight", L + "attention.query_key_value.weight", transform=NEOX_QKV),
    rule("body.blocks.{}.attn.qkv.bias", L + "attention.query_key_value.bias", transform=NEOX_QKV),
    *(rule(f"body.blocks.{{}}.{ours}.{p}", L + f"{theirs}.{p}")
      for ours, theirs in (("attn.proj", "attention.dense"), ("mlp.fc", "mlp.dense_h_to_4h"), ("mlp.proj", "mlp.dense_4h_to_h"))
      for p in ("weight", "bias")),
    rule("norm.weight", "gpt_neox.final_layer_norm.weight"),
    rule("norm.bias", "gpt_neox.final_layer_norm.bias"),
    rule("lm_head.weight", "lm_head.weight", when=lambda c: not c.tie_embeddings),
)


def neox_config(hf: Any, name: str) -> DecoderConfig:
    require(hf.hidden_act in PLAIN_ACTIVATIONS, hf, f"hidden_act={hf.hidden_act!r}")
    require(hf.attention_bias, hf, "attention without biases (its MLP keeps them)")
    head_dim = hf.hidden_size // hf.num_attention_heads
    pct = hf.rope_parameters.get("partial_rotary_factor", 1.0)
    require(int(head_dim * pct) % 2 == 0, hf, f"an odd rotary width {int(head_dim * pct)}")
    return DecoderConfig(
        **common_fields(hf, name), norm="layernorm", norm_eps=hf.layer_norm_eps, mlp=PLAIN_ACTIVATIONS[hf.hidden_act],
        bias=True, rotary_pct=pct, rope_base=rope_theta(hf), parallel_residual=bool(hf.use_parallel_residual),
    )


def neox_hf_config(c: DecoderConfig) -> Any:
    from transformers import GPTNeoXConfig

    act = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}.get(c.mlp, c.mlp)
    return GPTNeoXConfig(
        **hf_common_fields(c), layer_norm_eps=c.norm_eps, hidden_act=act, attention_bias=True,
        use_parallel_residual=c.parallel_residual,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base, "partial_rotary_factor": c.rotary_pct},
    )


GPT_NEOX = Architecture("gpt_neox", "GPTNeoXForCausalLM", NEOX_KEYS, neox_config, neox_hf_config)
