"""How the runtime splits a tensor's dim-0 rows over ``ranks`` ranks: ``ceil(rows / ranks)`` a rank, the last
ranks' rows padded with zeros, so every rank's piece has one size. Per-parameter sharding splits each parameter so
(:mod:`parallelisms.parallel.fsdp2`, FSDP2's ``Shard(0)``: a unit gathers in one collective), and tensor
parallelism the vocabulary of the embedding and the head (:mod:`parallelisms.parallel.tensor_plan`). Torch-free:
the performance model prices the padding with the same arithmetic.
"""

from __future__ import annotations


def rows_per_rank(rows: int, ranks: int) -> int:
    """Dim-0 rows each rank holds of a tensor with ``rows`` rows (padded)."""
    return -(-rows // ranks)


def padding_rows(rows: int, ranks: int) -> int:
    """Zero rows the padding adds to a tensor with ``rows`` rows over ``ranks`` ranks."""
    return rows_per_rank(rows, ranks) * ranks - rows
