"""Turning trained models into other families (uptraining initialisations)."""

from blockloop.convert.to_block import vanilla_to_block

__all__ = ["vanilla_to_block"]
