"""Memory-bandwidth roofline of a decode step: bytes of weights + KV read per generated token.

Decoding is memory bound, so a step cannot beat ``bytes read / bandwidth``. Per family, averaged over
the ``gen_len`` decode steps after a ``prompt_len`` prompt (``B`` rows, KV entries of ``e`` bytes):

* vanilla decoder: all weights, plus K and V of every layer for the ``P + G/2`` tokens of the average row;
* Block Transformer (section 2, Table 1): the embedder and block decoder (weights and a block KV cache of
  ``(P + G/2) / L_B`` entries) run once every ``L_B`` tokens; the token decoder (weights, and a local
  cache of ``n_lead + (L_B - 1) / 2`` entries on average) runs every token;
* recursive (RRT section 2.2): the shared layers' weights once per loop, KV of every depth position;
* double decoder (section 3.3): only the generation layers and head run; they read cross K/V of the
  ``P - 1`` prompt latents and their own K/V of ``G / 2`` generated tokens on average.

Other families return None (no roofline yet). Embedding rows read by a lookup are not counted.
"""

from __future__ import annotations

from torch import nn

from blockloop.config import DecoderConfig


def _kv_entry_bytes(config: DecoderConfig, n_layer: int, element: int) -> int:
    return 2 * n_layer * config.n_kv_head * config.head_dim * element


def _param_bytes(*modules: nn.Module) -> int:
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def bytes_per_step(model: nn.Module, batch: int, prompt_len: int, gen_len: int) -> float | None:
    """Average bytes one decode step must read for ``batch`` rows (see the module docstring)."""
    c = model.config
    element = next(model.parameters()).element_size()
    context = prompt_len + gen_len / 2
    if c.family == "decoder":
        weights = _param_bytes(model) - model.embed.weight.numel() * element * (not c.tie_embeddings)
        return weights + batch * context * _kv_entry_bytes(c, c.n_layer, element)
    if c.family == "recursive":  # the shared layers are read once per loop; one KV entry per depth position
        weights = _param_bytes(model) + (c.loops - 1) * _param_bytes(model.body.blocks)
        weights -= model.embed.weight.numel() * element * (not c.tie_embeddings)
        return weights + batch * context * _kv_entry_bytes(c, c.depth, element)
    if c.family == "block":
        block_len = c.block_len
        slow = _param_bytes(model.embedder, model.block_decoder) + batch * context / block_len * _kv_entry_bytes(
            c.block_decoder_config(), c.block_n_layer, element)
        td = model.token_decoder
        fast = _param_bytes(td.body, td.context_proj, td.lm_head) + batch * (c.n_lead + (block_len - 1) / 2) * _kv_entry_bytes(
            c.token_decoder_config(), c.token_n_layer, element)
        return fast + slow / block_len
    if c.family == "double_decoder":
        weights = _param_bytes(model.generation, model.norm, model.lm_head)
        return weights + batch * (prompt_len - 1 + gen_len / 2) * _kv_entry_bytes(c, c.n_generation_layer, element)
    return None
