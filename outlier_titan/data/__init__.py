"""Data: tokenizer (tiktoken), document sources, the synthetic Bigram-Backcopy task, packing into a
rank-independent token stream, stateful loader."""

from outlier_titan.data.loader import TokenDataLoader, build_dataloader
from outlier_titan.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["Tokenizer", "build_tokenizer", "build_dataloader", "TokenDataLoader"]
