"""Model families, built from their configs by :func:`build_model`."""

from __future__ import annotations

from torch import nn

from blockloop.config import DecoderConfig
from blockloop.models.decoder import Decoder

MODEL_CLASSES: dict[str, type[nn.Module]] = {"decoder": Decoder}


def build_model(config: DecoderConfig) -> nn.Module:
    """The model for ``config``'s family; later families register themselves in MODEL_CLASSES."""
    return MODEL_CLASSES[config.family](config)


__all__ = ["Decoder", "MODEL_CLASSES", "build_model"]
