"""Built-in corpus, byte-level tokenizer, and the deterministic global-batch loader.

The names load on first use (PEP 562): the command line reads ``parallelisms.data.options`` without torch.
"""

__all__ = ["BatchLoader", "ByteTokenizer", "load_corpus"]


def __getattr__(name: str):
    if name in __all__:
        from parallelisms.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'parallelisms.data' has no attribute {name!r}")
