"""Training data for the embedded trainer: local corpora, byte-level tokens, packed sequences.

>>> from nemo_fp8_recipes.data import DataConfig, load_corpus
>>> corpus = load_corpus(DataConfig(source="stdlib", max_files=50))

The default corpus is the Python standard library of the running interpreter, so a fresh
machine trains without a download. See :mod:`.corpus` for sources and the cache, and
:mod:`.loader` for packing and the resumable batch order.
"""

from .corpus import (
    Corpus,
    DataConfig,
    DataError,
    SourceFile,
    default_cache_dir,
    is_validation_doc,
    iter_documents,
    list_source_files,
    load_corpus,
    stdlib_root,
)
from .loader import PackedTokens, TrainBatches, ValBatches
from .tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DataConfig",
    "DataError",
    "SourceFile",
    "PackedTokens",
    "TrainBatches",
    "ValBatches",
    "default_cache_dir",
    "is_validation_doc",
    "iter_documents",
    "list_source_files",
    "load_corpus",
    "stdlib_root",
]
