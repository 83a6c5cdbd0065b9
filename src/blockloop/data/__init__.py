"""Data layer: corpora, tokenizers, cached token streams and batch iterators."""

# The task package registers its tokenizer's saved form with load_tokenizer: imported with the data layer.
from blockloop.data import tasks
from blockloop.data.corpora import BUILTIN_CORPORA, load_documents
from blockloop.data.dataset import TokenSplits, prepare_tokens
from blockloop.data.loader import PackedSequences, TrainBatches, eval_batches
from blockloop.data.packages import cache_dir, fetch_package_files
from blockloop.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer, load_tokenizer

__all__ = [
    "BUILTIN_CORPORA",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedSequences",
    "TokenSplits",
    "Tokenizer",
    "TrainBatches",
    "build_tokenizer",
    "cache_dir",
    "eval_batches",
    "fetch_package_files",
    "load_documents",
    "load_tokenizer",
    "prepare_tokens",
    "tasks",
]
