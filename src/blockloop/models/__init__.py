"""Model families, built from their configs by :func:`build_model`."""

from __future__ import annotations

from torch import nn

from blockloop.config import ModelConfig
from blockloop.models.block import BlockTransformer
from blockloop.models.decoder import Decoder
from blockloop.models.double_decoder import DoubleDecoder
from blockloop.models.encoder_decoder import EncoderDecoder
from blockloop.models.recursive import RecursiveDecoder

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "decoder": Decoder,
    "double_decoder": DoubleDecoder,
    "encoder_decoder": EncoderDecoder,
    "block": BlockTransformer,
    "recursive": RecursiveDecoder,
}


def build_model(config: ModelConfig) -> nn.Module:
    """The model for ``config``'s family; later families register themselves in MODEL_CLASSES."""
    return MODEL_CLASSES[config.family](config)


__all__ = ["BlockTransformer", "Decoder", "DoubleDecoder", "EncoderDecoder", "MODEL_CLASSES", "RecursiveDecoder", "build_model"]
