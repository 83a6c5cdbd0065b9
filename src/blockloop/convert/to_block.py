"""Initialise a Block Transformer from a trained vanilla decoder for uptraining (section 3.7, appendices G.8, N).

Following appendix N: (1) the vanilla layers are split in half, the lower half becoming the block
decoder and the upper half the token decoder (same width, so nothing is resized); (2) the input block
embedding starts as the *average* of its tokens' vanilla embeddings, through the fully connected layer
of G.8 that maps the L_B concatenated embeddings to the block width; (3) the token decoder's prefix
starts as copies of the context embedding. The token decoder keeps the vanilla embedding table, final
norm and LM head. The block decoder's final norm starts at unit gain (and zero bias): it still normalises,
so the prefix starts as a normalised state the vanilla upper half never saw; it is the one new normalisation
between the two halves, and uptraining adapts the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from blockloop.config import DecoderConfig
from blockloop.errors import BlockloopError
from blockloop.families.block import BlockTransformerConfig
from blockloop.models.block import BlockTransformer
from blockloop.models.decoder import Decoder


def check_block_options(block_len: int, prefix_len: int) -> None:
    """Refuse sizes no Block Transformer has, before any model is read."""
    for flag, value in (("--block-len (block_len)", block_len), ("--prefix-len (prefix_len)", prefix_len)):
        if value < 1:
            raise BlockloopError(f"{flag} of a Block Transformer must be at least 1, got {value}")


def block_config_from_vanilla(config: DecoderConfig, *, block_len: int, prefix_len: int, pad_id: int) -> BlockTransformerConfig:
    check_block_options(block_len, prefix_len)
    if config.n_layer < 2:
        raise BlockloopError(f"a vanilla model with {config.n_layer} layer cannot be split into block and token decoders")
    if config.context_length % block_len:
        raise BlockloopError(
            f"the model context {config.context_length} is not a multiple of --block-len {block_len}; choose a divisor"
        )
    if config.context_length < 2 * block_len:
        raise BlockloopError(
            f"--block-len {block_len} leaves the model context of {config.context_length} tokens one block, and the "
            f"first block is never predicted: the model could not be trained, evaluated or used to generate; choose a "
            f"--block-len of at most {config.context_length // 2}"
        )
    missing = _features_block_models_lack(config)
    if missing:
        raise BlockloopError(f"{config.name} uses {', '.join(missing)}, which the Block Transformer does not have: its "
                             "block model would start as a different model, not from this one; convert a model "
                             "without them (a Llama- or Pythia-style decoder)")
    lower = config.n_layer // 2
    shape = dict(d_model=config.d_model, n_head=config.n_head, n_kv_head=config.n_kv_head, d_ff=config.d_ff)
    return BlockTransformerConfig(
        name=f"{config.name}-block{block_len}",
        vocab_size=config.vocab_size,
        padded_vocab_size=config.padded_vocab_size,
        context_length=config.context_length,
        block_len=block_len,
        pad_id=pad_id,
        embedder="lookup",
        embed_dim=config.d_model,
        token_decoder="prefix",
        prefix_len=prefix_len,
        **{f"block_{k}": v for k, v in shape.items()},
        block_n_layer=lower,
        **{f"token_{k}": v for k, v in shape.items()},
        token_n_layer=config.n_layer - lower,
        tie_embeddings=config.tie_embeddings,
        **config.style(),
    )


def _features_block_models_lack(config: DecoderConfig) -> list[str]:
    """The source's features with no counterpart in :class:`BlockTransformerConfig` (whose layers read only the
    shared layer style): carried over they would be dropped, so the conversion refuses them by name."""
    features = (("learned positions", config.learned_positions), ("embedding scaling", config.embed_scale),
                ("q/k norms", config.qk_norm), ("sandwich norms", config.sandwich_norm),
                ("an attention scale", config.attn_scalar is not None),
                ("logit soft-capping", config.logit_softcap is not None),
                ("sliding-window layers", config.sliding_window is not None or bool(config.local_layers)),
                (f"head_dim {config.head_dim} (not d_model / n_head)", config.head_dim * config.n_head != config.d_model))
    return [name for name, used in features if used]


@torch.no_grad()
def vanilla_to_block(vanilla: Decoder, *, block_len: int = 4, prefix_len: int = 2, pad_id: int = 0) -> BlockTransformer:
    """A Block Transformer initialised from ``vanilla`` as described in the module docstring."""
    if type(vanilla) is not Decoder:  # a looped model is a Decoder subclass whose layers do not map one to one
        raise BlockloopError(f"only vanilla decoders convert to block models, not {vanilla.config.family} models")
    config = block_config_from_vanilla(vanilla.config, block_len=block_len, prefix_len=prefix_len, pad_id=pad_id)
    model = BlockTransformer(config).to(vanilla.embed.weight.dtype)
    d, lower = config.block_d_model, config.block_n_layer
    model.embedder.embed.weight.copy_(vanilla.embed.weight)
    model.embedder.proj.weight.copy_(torch.cat([torch.eye(d)] * block_len, dim=1) / block_len)
    for target, source in zip(model.block_decoder.blocks, vanilla.body.blocks[:lower]):
        target.load_state_dict(source.state_dict())
    tokdec = model.token_decoder
    for target, source in zip(tokdec.body.blocks, vanilla.body.blocks[lower:]):
        target.load_state_dict(source.state_dict())
    tokdec.body.norm.load_state_dict(vanilla.norm.state_dict())
    tokdec.embed.weight.copy_(vanilla.embed.weight)
    if not config.tie_embeddings:
        tokdec.lm_head.weight.copy_(vanilla.lm_head.weight)
    tokdec.context_proj.weight.copy_(torch.cat([torch.eye(d)] * prefix_len, dim=0))
    _reset_norm(model.block_decoder.norm)
    return model


def _reset_norm(norm: nn.Module) -> None:
    nn.init.ones_(norm.weight)
    if getattr(norm, "bias", None) is not None:
        nn.init.zeros_(norm.bias)
