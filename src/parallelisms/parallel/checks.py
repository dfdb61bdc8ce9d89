"""The rules of the parallelisms that are checked before any process starts, in a module without torch: the
command line validates a layout (``parallelisms.support``) and ``estimate``, ``plan`` and ``--help`` run without
importing torch. The engines that follow these rules import them from here.
"""

from __future__ import annotations

from parallelisms.errors import divisors, require

# FSDP1's sharding strategies (:mod:`parallelisms.parallel.fsdp`), and the ones that need a 2-D
# ``dp_replicate x dp_shard`` mesh
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
HYBRID = ("hybrid_shard", "hybrid_shard_zero2")


def check_context_parallel(style: str, cp: int, n_heads: int, n_kv_heads: int, seq_len: int) -> None:
    """One-line errors for layouts context parallelism cannot run (before launch)."""
    require(style in ("ring", "ulysses"), f"unknown context-parallel attention {style!r}; choose ring or ulysses")
    if style == "ring":
        require(seq_len % (2 * cp) == 0, f"ring attention with --cp {cp} cuts the sequence into 2 x cp = {2 * cp} "
                                          f"zigzag chunks, but --seq-len {seq_len} is not divisible by {2 * cp}")
    else:
        require(seq_len % cp == 0, f"--seq-len {seq_len} must be divisible by --cp {cp}")

        def fits(d: int) -> bool:
            return n_heads % d == 0 and (n_kv_heads % d == 0 or d % n_kv_heads == 0)
        require(fits(cp), lambda: f"Ulysses --cp {cp} gives each rank heads/cp query heads and needs n_kv_heads a "
                                  f"multiple or a divisor of cp, but n_heads {n_heads} and n_kv_heads {n_kv_heads} "
                                  f"do not fit {cp} (per tensor-parallel rank); use --cp-attention ring or --cp in "
                                  f"{list(filter(fits, divisors(n_heads)))}")
