"""What one Hugging Face architecture needs to convert: config translation both ways and a key map."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blockloop.config import DecoderConfig
from blockloop.convert.keymap import KeyMap
from blockloop.errors import BlockloopError

# Hugging Face activation names -> blockloop MLP kinds, for plain (non-gated) MLPs.
PLAIN_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Architecture:
    """``model_type`` is Hugging Face's name; ``hf_class`` the causal-LM class that exports load into."""

    model_type: str
    hf_class: str
    keymap: KeyMap
    to_config: Callable[[Any, str], DecoderConfig]
    from_config: Callable[[DecoderConfig], Any]


def rope_theta(hf_config: Any, layer_type: str | None = None) -> float:
    """The rotary base of plain (unscaled) RoPE; scaled variants (linear, YaRN, Llama-3) are not implemented."""
    params = hf_config.rope_parameters
    if layer_type is not None:
        params = params[layer_type]
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise BlockloopError(
            f"{hf_config.model_type}: RoPE scaling {kind!r} is not supported; only plain RoPE converts"
        )
    return float(params["rope_theta"])


def require(ok: bool, hf_config: Any, message: str) -> None:
    if not ok:
        raise BlockloopError(f"{hf_config.model_type}: {message}; this checkpoint cannot be converted exactly")


def common_fields(hf_config: Any, name: str) -> dict[str, Any]:
    """Fields every architecture reads the same way."""
    return {
        "name": name,
        "vocab_size": hf_config.vocab_size,
        "context_length": hf_config.max_position_embeddings,
        "tie_embeddings": bool(hf_config.tie_word_embeddings),
        "n_layer": hf_config.num_hidden_layers,
        "n_head": hf_config.num_attention_heads,
        "d_model": hf_config.hidden_size,
        "d_ff": hf_config.intermediate_size,
    }


def hf_common_fields(c: DecoderConfig) -> dict[str, Any]:
    """The inverse of :func:`common_fields` (padded vocabulary rows become the exported vocabulary)."""
    return {
        "vocab_size": c.padded_vocab_size,
        "max_position_embeddings": c.context_length,
        "tie_word_embeddings": c.tie_embeddings,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
    }
