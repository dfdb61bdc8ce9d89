"""ZeRO-1/2/3 (Rajbhandari et al., SC'20) as plans of the flat-parameter engine, and the choice of plan for
every sharded data-parallel layout (ZeRO stages and FSDP strategies alike).

* Stage 1: optimizer state (and fp32 master weights in bf16) partitioned. The full gradient persists and
  accumulates locally across microbatches; after the last one each unit's gradient is reduce-scattered
  from its backward hook (units are the buckets: consecutive blocks merged under ``--bucket-mb``,
  launched in ready order, one in flight), each rank runs AdamW on its flat fp32 shard, and an
  all-gather refreshes the full parameters (``--overlap-param-gather``: launched after the step and
  completed unit by unit in the next forward, Megatron-LM's distributed optimizer).
* Stage 2: gradients partitioned too: every microbatch reduce-scatters each unit's gradient and keeps
  only the reduced shard (G/N persistent, plus the buckets in flight).
* Stage 3: parameters partitioned too: a unit is all-gathered just before its forward (the next one is
  prefetched) and again before its backward, freed after each, its gradient reduce-scattered to owners.

API: ``zero_plan(stage, compute_dtype)`` gives the :class:`ShardingPlan`;
``sharded_grad_sync(model, parallel, train, comms)`` picks the plan from a :class:`ParallelConfig` and returns
the engine (a ``GradSync``: the training step is the same for every layout); a pipeline stage's engine holds
its units through the step (:mod:`parallelisms.parallel.pipeline.stage_sync`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.config import ParallelConfig, TrainConfig
from parallelisms.parallel.flat import ShardedEngine, ShardingPlan
from parallelisms.parallel.wrap import module_units
from parallelisms.parallel.fsdp import fsdp_plan
from parallelisms.parallel.shard_group import shard_dim, with_cp
from parallelisms.options import Precision

def zero_plan(stage: int, compute_dtype: torch.dtype = torch.float32) -> ShardingPlan:
    """ZeRO stage 1, 2 or 3 over the flattened data-parallel dimension ``dp``."""
    return ShardingPlan(shard_params=stage >= 3, shard_grads=stage >= 2, reshard_after_forward=True,
                        shard_dim="dp", replicate_dim=None, compute_dtype=compute_dtype)


def sharded_grad_sync(model: nn.Module, parallel: ParallelConfig, train: TrainConfig, comms: Comms) -> ShardedEngine:
    """The flat engine for ``--zero K`` or ``--fsdp STRATEGY`` (flat style) over ``model`` (or one pipeline
    stage). With context parallelism the ranks of dp x cp hold different tokens of the
    same model, so they shard (or replicate) over ``dp_cp``, as Megatron's distributed optimizer does; the
    hybrid strategies shard over ``dp_shard_cp`` (dp_shard x cp, torchtitan's FSDP mesh) and replicate over
    ``dp_replicate``."""
    # bf16 compute over fp32 master weights, or the parameters' own dtype (fp32; float64 under verify --dtype)
    dtype = torch.bfloat16 if parallel.mixed_precision is Precision.BF16 else next(model.parameters()).dtype
    # neither: mixed precision over plain data parallelism, the NO_SHARD plan (DDP with fp32 master weights)
    plan = zero_plan(parallel.zero, dtype) if parallel.zero else fsdp_plan(parallel.fsdp or "no_shard", dtype)
    plan = dataclasses.replace(plan, shard_dim=shard_dim(parallel),
                               replicate_dim=with_cp(plan.replicate_dim, parallel))
    # ZeRO-1/2 communicate gradients in buckets under --bucket-mb; ZeRO-3 and FSDP per block
    cap = int(train.bucket_mb * 2**20) if parallel.zero in (1, 2) else None
    return ShardedEngine(model, module_units(model, cap), plan, comms,
                         overlap_param_gather=parallel.overlap_param_gather, prefetch=parallel.fsdp_prefetch)
