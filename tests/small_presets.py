"""Every registered preset at CPU-test size: the same family and options, a tiny vocabulary, width and depth."""

from __future__ import annotations

import dataclasses

from blockloop.config import ModelConfig
from blockloop.families import from_name


def small_variant(name: str) -> ModelConfig:
    """Preset ``name`` shrunk to 2 layers of width 32 over 64 token ids (two-stack splits 1 + 1)."""
    config = from_name(name)
    fields = {f.name for f in dataclasses.fields(config)}
    o = {"vocab_size": 64, "padded_vocab_size": 64 + config.reserved_ids}
    if "d_model" in fields:
        o.update(n_layer=2, d_model=32, n_head=2, n_kv_head=2, head_dim=None, d_ff=None)
    if "n_context_layer" in fields:
        o.update(n_context_layer=1, n_generation_layer=1)
    if "n_encoder_layer" in fields:
        o.update(n_encoder_layer=1, n_decoder_layer=1)
    if "block_d_model" in fields:
        shape = dict(n_layer=1, d_model=32, n_head=2, n_kv_head=None, d_ff=None)
        o.update({f"{part}_{k}": v for part in ("block", "token") for k, v in shape.items()})
        o.update(embed_dim=None)
        if config.embedder != "lookup":  # only the encoder and cls embedders have a transformer to shrink
            o.update(embedder_n_layer=1, embedder_n_head=2)
    return from_name(name, **o)
