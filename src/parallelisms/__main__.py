"""``python -m parallelisms``: the same command line as ``parallelisms``."""

from parallelisms.cli import entry

entry()
