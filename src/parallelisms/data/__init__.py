"""Built-in corpus, byte-level tokenizer, and the deterministic global-batch loader."""

from parallelisms.data.loader import BatchLoader, ByteTokenizer, load_corpus

__all__ = ["BatchLoader", "ByteTokenizer", "load_corpus"]
