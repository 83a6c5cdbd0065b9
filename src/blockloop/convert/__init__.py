"""Turning models into other families (uptraining initialisations), and Hugging Face models in and out."""

from blockloop.convert.hf import export_hf, import_hf
from blockloop.convert.to_block import vanilla_to_block
from blockloop.convert.to_recursive import vanilla_to_recursive

__all__ = ["export_hf", "import_hf", "vanilla_to_block", "vanilla_to_recursive"]
