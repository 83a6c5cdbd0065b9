"""Turning trained models into other families (uptraining initialisations)."""

from blockloop.convert.to_block import vanilla_to_block
from blockloop.convert.to_recursive import vanilla_to_recursive

__all__ = ["vanilla_to_block", "vanilla_to_recursive"]
