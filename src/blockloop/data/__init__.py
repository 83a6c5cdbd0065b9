"""Data layer: corpora, tokenizers, cached token streams and batch iterators.

Import the module you need (``blockloop.data.tokenizers``, ``blockloop.data.loader``...): the package
itself imports nothing, so batching helpers load without the ``tokenizers`` package.
"""
