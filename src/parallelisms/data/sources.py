"""One's own training data: a text file, a directory of ``.txt`` files, or a pre-tokenized ``.bin``.

Text is tokenized by UTF-8 bytes (vocabulary 256, the default) or by a Hugging Face ``tokenizer.json`` through
the ``tokenizers`` library. A ``.bin`` is a flat array of uint16 or uint32 token ids, read through a memory map
(``np.memmap``), the convention of nanoGPT's ``prepare.py`` and Megatron's indexed datasets, so a corpus larger
than memory costs only the windows drawn. The last ``eval_split`` fraction of the tokens is held out for
validation. :func:`check_data` runs before launch and turns every problem (missing, empty or unreadable data, a
tokenizer whose vocabulary does not fit the model) into one line; :func:`train_and_eval_tokens` is what each
rank loads.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from parallelisms.config import DataConfig, ModelConfig
from parallelisms.data.loader import BatchLoader, ByteTokenizer, load_corpus
from parallelisms.errors import ConfigError, path_kind, require

BIN_DTYPES = ("uint16", "uint32")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (byte-pair, WordPiece, Unigram...) through the ``tokenizers`` library."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(path)
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        self.entries = len(ids)
        self.vocab_size = max(ids, default=-1) + 1  # the largest id + 1: ids need not be dense

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer.encode(text).ids, dtype=torch.long)

    def decode(self, tokens: torch.Tensor) -> str:
        return self.tokenizer.decode(tokens.tolist())


def tokenizer_for(cfg: DataConfig) -> ByteTokenizer | HFTokenizer:
    """``--tokenizer``'s tokenizer, or UTF-8 bytes."""
    if cfg.tokenizer is None:
        return ByteTokenizer()
    _readable("--tokenizer", Path(cfg.tokenizer), "a Hugging Face tokenizer.json")
    try:
        return HFTokenizer(cfg.tokenizer)
    except ImportError:
        raise ConfigError("--tokenizer needs the tokenizers package, which is not installed; pip install tokenizers, "
                          "or drop --tokenizer (byte-level tokens)") from None
    except Exception as exc:  # tokenizers raises its own exception type for a malformed file
        raise ConfigError(f"--tokenizer {cfg.tokenizer!r} is not a tokenizer.json the tokenizers library reads "
                          f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def _readable(flag: str, path: Path, what: str) -> None:
    kind = path_kind(path)
    require(kind in ("is a regular file", "is a directory"), f"{flag} {str(path)!r} {kind}; pass {what}")
    require(path.is_dir() or path.stat().st_size > 0, f"{flag} {str(path)!r} is empty; pass {what}")


def _text_files(path: Path) -> list[Path]:
    """A directory's ``.txt`` files, sorted, every subdirectory walked (symbolic links to directories not
    followed); a subdirectory that cannot be listed, or a ``.txt`` that is not a regular file, is one line."""
    if not path.is_dir():
        return [path]

    def refuse(exc: OSError):
        raise ConfigError(f"--data {str(path)!r}: the subdirectory {exc.filename!r} cannot be listed "
                          f"({exc.strerror}); make it readable, or move it out") from None
    files = []
    for folder, _, names in os.walk(path, onerror=refuse):
        for name in (n for n in names if n.endswith(".txt")):
            kind = path_kind(Path(folder, name))
            require(kind == "is a regular file", f"--data {str(path)!r}: {str(Path(folder, name))!r} {kind}; "
                                                 f"remove it or make it a text file")
            files.append(Path(folder, name))
    require(files, f"--data {str(path)!r} is a directory with no .txt files; put text files in it, or pass a file")
    return sorted(files)


def _read_text(path: Path) -> str:
    """The text of a file, or of a directory's ``.txt`` files in sorted order, separated by blank lines."""
    parts = []
    for file in _text_files(path):
        try:
            parts.append(file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"--data {str(file)!r} cannot be read ({exc.strerror}); pass a readable file") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"--data {str(file)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); pass text, "
                              f"or a pre-tokenized .bin") from None
    return "\n\n".join(parts)


def load_tokens(cfg: DataConfig) -> torch.Tensor | np.ndarray:
    """All tokens of ``cfg``: the built-in corpus, tokenized text, or a memory map of a ``.bin``."""
    if cfg.path is None:
        return load_corpus() if cfg.tokenizer is None else tokenizer_for(cfg).encode(_builtin_text())
    path = Path(cfg.path)
    _readable("--data", path, "a text file, a directory of .txt files or a .bin of token ids")
    if path.suffix == ".bin":
        require(cfg.tokenizer is None, f"--tokenizer with the pre-tokenized --data {cfg.path!r}: its tokens are "
                                       f"already ids; drop --tokenizer")
        require(cfg.bin_dtype in BIN_DTYPES, f"unknown --data-dtype {cfg.bin_dtype!r}; choose uint16 or uint32")
        itemsize = np.dtype(cfg.bin_dtype).itemsize
        size = path.stat().st_size
        require(size % itemsize == 0, f"--data {cfg.path!r} holds {size:,} bytes, not a whole number of "
                                      f"{cfg.bin_dtype} tokens; check --data-dtype")
        try:
            return np.memmap(path, dtype=cfg.bin_dtype, mode="r")
        except OSError as exc:
            raise ConfigError(f"--data {cfg.path!r} cannot be read ({exc.strerror}); pass a readable file") from None
    return tokenizer_for(cfg).encode(_read_text(path))


def _builtin_text() -> str:
    from importlib import resources
    return resources.files("parallelisms.data").joinpath("corpus.txt").read_text(encoding="utf-8")


def split_tokens(tokens, eval_split: float):
    """(training tokens, held-out tokens): the last ``eval_split`` fraction is held out (None when 0)."""
    if eval_split <= 0:
        return tokens, None
    cut = len(tokens) - int(len(tokens) * eval_split)
    return tokens[:cut], tokens[cut:]


TEXT_BYTES_PER_BYTE = 9  # a rank's text in memory: the string (1 byte a byte of ASCII) and its int64 byte tokens


def check_data_size(cfg: DataConfig, ranks: int, available: int | None = None) -> None:
    """Before reading it: text ``--data`` fits the memory of this machine, read and tokenized whole by the
    launcher and each of ``ranks`` processes (about :data:`TEXT_BYTES_PER_BYTE` bytes a byte of text); a ``.bin``
    is memory-mapped and costs only the windows drawn. ``available`` defaults to this machine's."""
    from parallelisms.fit import available_cpu_bytes
    from parallelisms.units import size

    if cfg.path is None or Path(cfg.path).suffix == ".bin" or path_kind(cfg.path) not in ("is a regular file",
                                                                                          "is a directory"):
        return  # the built-in corpus, a memory map, or a path that _readable names
    text = sum(f.stat().st_size for f in _text_files(Path(cfg.path)))
    need = text * TEXT_BYTES_PER_BYTE * (ranks + 1)
    available = available_cpu_bytes() if available is None else available
    require(available is None or need <= available,
            lambda: f"--data {cfg.path!r} holds {size(text)} of text, which the launcher and {ranks} rank(s) each "
                    f"read and tokenize whole (about {TEXT_BYTES_PER_BYTE} bytes a byte: {size(need)}), more than the "
                    f"{size(available)} of RAM available; pre-tokenize it into a .bin of token ids (memory-mapped), or "
                    f"pass less text")


def train_and_eval_tokens(cfg: DataConfig):
    """What each rank trains and validates on (deterministic: every rank reads the same)."""
    return split_tokens(load_tokens(cfg), cfg.eval_split)


def check_data(cfg: DataConfig, model: ModelConfig, seq_len: int) -> int:
    """Before launch: the data can be read and is long enough (training and held-out parts each longer than one
    window), and every token id fits the model's vocabulary. Returns the number of training tokens."""
    vocab = tokenizer_for(cfg).vocab_size if cfg.path is None or Path(cfg.path).suffix != ".bin" else None
    require(vocab is None or vocab <= model.vocab_size,
            lambda: f"--tokenizer {cfg.tokenizer!r} has token ids up to {vocab - 1:,} but the model's vocabulary is "
                    f"{model.vocab_size:,}; use a model with vocab_size >= {vocab:,} (--config) or a smaller tokenizer")
    tokens = load_tokens(cfg)
    source = repr(cfg.path) if cfg.path else "the built-in corpus"
    require(len(tokens) > 0, f"--data {source} holds no tokens; pass a non-empty file")
    if vocab is None:  # a .bin's largest id, read in chunks of the memory map
        top = max(int(tokens[i:i + (1 << 24)].max()) for i in range(0, len(tokens), 1 << 24))
        require(top < model.vocab_size, f"--data {source} holds token id {top:,} but the model's vocabulary is "
                                        f"{model.vocab_size:,}; use a model with vocab_size > {top:,} (--config)")
    train, held = split_tokens(tokens, cfg.eval_split)
    require(len(train) > seq_len + 1, f"--data {source} has {len(train):,} training tokens, fewer than --seq-len "
                                      f"{seq_len} + 2; use more data or a shorter --seq-len")
    if held is not None:
        require(len(held) > seq_len + 1, f"--eval-split {cfg.eval_split:g} of --data {source} holds out "
                                         f"{len(held):,} tokens, fewer than --seq-len {seq_len} + 2; raise "
                                         f"--eval-split or shorten --seq-len")
    return len(train)


def training_loader(cfg) -> BatchLoader:
    """The loader of ``cfg`` (a ``TrainConfig``): its data's training tokens, its global batch, length and seed.
    The training loop and every single-process reference draw their batches from it."""
    return BatchLoader(train_and_eval_tokens(cfg.data)[0], cfg.global_batch, cfg.seq_len, cfg.seed,
                       cfg.data.vocab_sweep)
