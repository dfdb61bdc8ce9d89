"""FSDP1 flat-parameter strategies (Zhao et al., VLDB'23) as configurations of the flat engine.

Each wrapping unit (embedding, one transformer block, head) is one flat parameter (``flat.FlatUnit``).
The strategies differ only in which states are sharded, when parameters are resharded, and whether a
replicate dimension all-reduces the reduced shards:

================== ============== ===================== ============ ============================
strategy           params sharded reshard after forward grads        mesh
================== ============== ===================== ============ ============================
full_shard         yes            yes (ZeRO-3)          sharded      dp
shard_grad_op      yes            no (ZeRO-2 + gather)  sharded      dp
no_shard           no             -                     all-reduced  dp (DDP on flat parameters)
hybrid_shard       yes            yes                   sharded      dp_shard, all-reduce dp_replicate
hybrid_shard_zero2 yes            no                    sharded      dp_shard, all-reduce dp_replicate
================== ============== ===================== ============ ============================

API: ``fsdp_plan(strategy, compute_dtype)`` gives the :class:`ShardingPlan`; ``STRATEGIES`` names them;
``HYBRID`` the ones that need a 2-D ``dp_replicate x dp_shard`` mesh.
"""

from __future__ import annotations

import torch

from parallelisms.options import FsdpStrategy
from parallelisms.parallel.checks import HYBRID, STRATEGIES
from parallelisms.parallel.flat import ShardingPlan


def fsdp_plan(strategy: str, compute_dtype: torch.dtype = torch.float32) -> ShardingPlan:
    """The engine configuration of an FSDP1 sharding strategy (names as ``--fsdp`` takes them)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown FSDP strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy == FsdpStrategy.NO_SHARD:
        return ShardingPlan(shard_params=False, shard_grads=False, shard_dim=None, replicate_dim="dp",
                            compute_dtype=compute_dtype)
    hybrid = strategy in HYBRID
    return ShardingPlan(shard_params=True, shard_grads=True,
                        reshard_after_forward=strategy in (FsdpStrategy.FULL_SHARD, FsdpStrategy.HYBRID_SHARD),
                        shard_dim="dp_shard" if hybrid else "dp",
                        replicate_dim="dp_replicate" if hybrid else None, compute_dtype=compute_dtype)
