"""The mesh dimension a layout's sharding engine splits parameters, gradients or optimizer state over (ZeRO,
every FSDP style), as :func:`parallelisms.parallel.zero.sharded_grad_sync` and the per-parameter engines of
:mod:`parallelisms.train_setup` take it. Context-parallel ranks hold different tokens of the same model, so with
cp the engines shard (or replicate) over the data-parallel ranks times cp, as Megatron's distributed optimizer and
torchtitan's FSDP mesh do. Torch-free: the performance model reads the same dimension.
"""

from __future__ import annotations

from parallelisms.options import FsdpStrategy, FsdpStyle

WITH_CP = {"dp": "dp_cp", "dp_shard": "dp_shard_cp"}


def with_cp(dim: str | None, parallel) -> str | None:
    """``dim`` widened over cp where the layout (a ``ParallelConfig``) has context parallelism."""
    return WITH_CP.get(dim, dim) if parallel.dims.cp > 1 else dim


def shard_dim(parallel) -> str | None:
    """The dimension the layout's engine shards over, None where nothing is sharded (DDP, NO_SHARD): dp_shard for
    hybrid FSDP (it replicates across dp_replicate) and the per-parameter styles, dp for ZeRO and flat FSDP, each
    :func:`with_cp`."""
    if not parallel.zero and (not parallel.fsdp or parallel.fsdp is FsdpStrategy.NO_SHARD):
        return None
    by_shard = parallel.fsdp and (parallel.fsdp.hybrid or parallel.fsdp_style is not FsdpStyle.FLAT)
    return with_cp("dp_shard" if by_shard else "dp", parallel)
