"""Turning models into other families (uptraining initialisations), and Hugging Face models in and out.

Import the module you need (``blockloop.convert.to_recursive``, ``blockloop.convert.hf``...): the package
itself imports nothing, so the table of ``convert --to`` targets loads without torch.
"""
