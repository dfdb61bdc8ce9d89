"""How a layout is applied: :func:`parallelize` turns the full seeded model into this rank's part in one
straight line (the parallelisms' module swaps in the registry's order: tensor/sequence parallelism, context
parallelism, expert parallelism, recomputation; then the pipeline cut, then the gradient sync) and returns the
:class:`parallelisms.trainer.Trainer` that steps it.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.optim import sharded_optimizer
from parallelisms.parallel.data import DataParallel
from parallelisms.parallel.ep_balance import ExpertBalance
from parallelisms.parallel.fsdp2 import PerParamSharding
from parallelisms.parallel.grad_sync import GradSync, LocalGradients
from parallelisms.parallel.pipeline.executor import WeightGradStore, split_linears
from parallelisms.parallel.pipeline.runner import PipelineSchedule, cut_stages
from parallelisms.parallel.pipeline.schedules import schedule_for
from parallelisms.parallel.pipeline.stage_sync import StageSyncs
from parallelisms.parallel.registry import module_swaps
from parallelisms.parallel.shard_group import shard_dim
from parallelisms.parallel.tied import TiedEmbeddings, untie
from parallelisms.parallel.yafsdp import ReuseSharding
from parallelisms.parallel.zero import sharded_grad_sync
from parallelisms.trainer import MicrobatchLoop, Trainer
from parallelisms.options import Balance, FsdpStrategy, FsdpStyle, Precision


def parallelize(model: nn.Module, parallel: ParallelConfig, train: TrainConfig, comms: Comms,
                bounds: list[int] | None = None, layer_costs: tuple | None = None) -> Trainer:
    """Apply the layout to the full seeded model, always in this order: the descriptors' module swaps in the
    registry's order (:func:`~parallelisms.parallel.registry.module_swaps`: tensor/sequence parallelism, context
    parallelism, expert parallelism, recomputation; each a swap every stage shares), then the pipeline cut (this
    rank's stages), then the gradient sync over data parallelism; return the ``Trainer`` with the step's
    forward/backward strategy (a microbatch loop, or the pipeline schedule, whose hooks carry the
    stages' gradient sync and PipeDream's per-microbatch updates).
    Each parallelism's transform lives in its own module. ``bounds``
    fixes the pipeline stages' layer bounds (the balance benchmark compares cuts); ``layer_costs``: the costs
    ``--pp-balance measured`` cuts by in place of rank 0's profile (the dry run's: ``measured_bounds``)."""
    dims = parallel.dims
    positions = None  # this rank's token positions, where a swap reorders the sequence (context parallelism)
    for swap in module_swaps():
        placed = swap(model, comms, parallel, train)
        if placed is not None:
            positions = placed
    schedule, stages, copies = None, {0: model}, set()
    if not parallel.one_tied_parameter():  # the last stage holds a copy of the tied weight
        untie(model)
    if dims.pp > 1:
        schedule = schedule_for(parallel)
        stages, copies, bounds = cut_stages(model, parallel, train, comms, schedule, bounds, layer_costs)
    store = WeightGradStore()
    if schedule is not None and schedule.split_backward:  # before the sync: sharding engines own the weights
        for stage in stages.values():
            split_linears(stage, store)
            if stage.output is not None and stage.output is not model.output and model.output is not None:
                model.output = stage.output  # the full model shares the swapped head, not the old one's weight
    grad_sync = _grad_sync(model, stages, copies, parallel, train, comms, schedule)
    balance = None
    if parallel.ep_balance is Balance.MEASURED:  # copies of an expert kept one expert; the placement moved between steps
        grad_sync = balance = ExpertBalance(grad_sync, stages, copies, comms, parallel.ep_redundant,
                                            parallel.ep_rebalance_every,
                                            per_update=schedule is not None and schedule.updates_per_microbatch)
    if model.cfg.tie_embeddings:
        grad_sync = TiedEmbeddings(grad_sync, comms)
    compute_dtype = torch.bfloat16 if parallel.mixed_precision is Precision.BF16 else None  # None: the parameters' dtype
    if schedule is None:
        trainer = Trainer(grad_sync, MicrobatchLoop(model, comms, train.grad_accum, positions), comms, train,
                          _optimizer(grad_sync, model.cfg, train))
        trainer.ep_balance = balance
        return trainer
    pipeline = PipelineSchedule(schedule, stages, comms, model.cfg.dim, bounds, store, grad_sync, train,
                                positions=positions, dtype=compute_dtype)
    if pipeline.updates is not None:  # the schedule's update hooks step each stage (PipeDream): no step of its own
        trainer = Trainer(grad_sync, pipeline, comms, train, None, pipeline.updates.optimizers.values())
    else:
        trainer = Trainer(grad_sync, pipeline, comms, train, _optimizer(grad_sync, model.cfg, train))
    trainer.ep_balance = balance
    return trainer


def _optimizer(grad_sync: GradSync, model_cfg: ModelConfig, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the gradient sync's parameters, weight decay on the elements of weight matrices
    (:mod:`parallelisms.optim`); a tied weight is one entry (:mod:`parallelisms.parallel.tied`)."""
    return sharded_optimizer(grad_sync.placements(), train, model_cfg.tie_embeddings)


def _grad_sync(model: nn.Module, stages: dict, copies: set, parallel: ParallelConfig, train: TrainConfig,
               comms: Comms, schedule=None) -> GradSync:
    """How gradients reach the optimizer: the layout's engine (:func:`_engine`) over the model, or, pipelined,
    the same engine over each stage of this rank (:class:`StageSyncs`)."""
    if schedule is None:
        return _engine(model, parallel, train, comms)
    # PipeDream's weight stash casts each version itself (bf16), over the stage's fp32 weights
    casts = schedule.updates_per_microbatch
    return StageSyncs({s: _engine(stage, parallel, train, comms, casts) for s, stage in stages.items()}, copies, comms)


def _engine(module: nn.Module, parallel: ParallelConfig, train: TrainConfig, comms: Comms,
            weights_cast_elsewhere: bool = False) -> GradSync:
    """The gradient sync of ``module`` (the model or one pipeline stage): a sharding engine (ZeRO, FSDP flat,
    per-parameter FSDP or buffer reuse), DDP over every rank that saw other tokens (dp x cp; expert weights
    over their replicas), or plain local gradients."""
    dims = parallel.dims
    # mixed precision without sharding is DDP over the flat engine's NO_SHARD plan: bf16 weights and compute,
    # fp32 master weights and gradients, all-reduced
    mixed = parallel.mixed_precision is Precision.BF16 and not weights_cast_elsewhere
    if parallel.zero or parallel.fsdp or mixed:
        return _sharding_engine(module, parallel, train, comms)
    if dims.dp * dims.cp > 1:  # context-parallel ranks hold different tokens: average over both
        replica_comms = {"ep": comms["ep_replicate"]} if dims.ep > 1 else None
        return DataParallel(module, comms, "dp_cp", bucket_cap_mb=train.bucket_mb,
                            find_unused_parameters=parallel.find_unused_parameters, replica_comms=replica_comms)
    return LocalGradients(module, comms)


def _sharding_engine(module: nn.Module, parallel: ParallelConfig, train: TrainConfig, comms: Comms):
    """The engine of --zero / --fsdp over ``module`` (the model, or one pipeline stage): flat, per-parameter
    (FSDP2) or buffer reuse (YaFSDP), over :func:`~parallelisms.parallel.shard_group.shard_dim` (the per-parameter
    engines: dp_shard, and with context parallelism dp_shard x cp, those ranks holding different tokens)."""
    dim = shard_dim(parallel)
    compute = torch.bfloat16 if parallel.mixed_precision is Precision.BF16 else None  # None: the parameters' dtype
    if parallel.fsdp and parallel.fsdp_style is FsdpStyle.REUSE:
        return ReuseSharding(module, comms, dim, compute_dtype=compute)
    if parallel.fsdp and parallel.fsdp_style is FsdpStyle.PER_PARAM:
        return PerParamSharding(module, comms, dim, reshard_after_forward=parallel.fsdp is not FsdpStrategy.SHARD_GRAD_OP,
                                compute_dtype=compute)
    return sharded_grad_sync(module, parallel, train, comms)
