"""ZeRO-1/2/3 (Rajbhandari et al., SC'20) as plans of the flat-parameter engine, and the runner of every
sharded data-parallel layout (ZeRO stages and FSDP strategies alike).

* Stage 1: optimizer state (and fp32 master weights in bf16) partitioned. The full gradient persists and
  accumulates locally across microbatches; after the last one each unit's gradient is reduce-scattered
  from its backward hook (units are the buckets: consecutive blocks merged under ``--bucket-mb``,
  launched in ready order, one in flight), each rank runs AdamW on its flat fp32 shard, and an
  all-gather refreshes the full parameters.
* Stage 2: gradients partitioned too: every microbatch reduce-scatters each unit's gradient and keeps
  only the reduced shard (G/N persistent, plus the buckets in flight).
* Stage 3: parameters partitioned too: a unit is all-gathered just before its forward (the next one is
  prefetched) and again before its backward, freed after each, its gradient reduce-scattered to owners.

API: ``zero_plan(stage, compute_dtype)`` gives the :class:`ShardingPlan`;
``ShardedRunner(model, comms, train_cfg, plan, units=None)`` is a :class:`parallelisms.train.Runner`
(units default to ``module_units(model)``, one per block);
``parallelize_sharded(model, parallel, train, comms)`` picks the plan from a :class:`ParallelConfig`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.config import ParallelConfig, TrainConfig
from parallelisms.parallel.common import norm_of_groups
from parallelisms.parallel.flat import ShardedEngine, ShardingPlan, module_units
from parallelisms.parallel.memory import memory_report
from parallelisms.train import Runner, make_optimizer

def zero_plan(stage: int, compute_dtype: torch.dtype = torch.float32) -> ShardingPlan:
    """ZeRO stage 1, 2 or 3 over the flattened data-parallel dimension ``dp``."""
    return ShardingPlan(shard_params=stage >= 3, shard_grads=stage >= 2, reshard_after_forward=True,
                        shard_dim="dp", replicate_dim=None, compute_dtype=compute_dtype)


class ShardedRunner(Runner):
    """A training step whose optimizer sees only this rank's flat fp32 shards (any :class:`ShardingPlan`)."""

    def __init__(self, model: nn.Module, comms: Comms, cfg: TrainConfig, plan: ShardingPlan, units=None,
                 positions: torch.Tensor | None = None):
        super().__init__(model, comms, cfg, None, positions)  # base state; params and optimizer replaced below
        self.plan = plan
        self.engine = ShardedEngine(model, units if units is not None else module_units(model), plan, comms)
        self.grad_sync = self.engine
        self.params = self.engine.parameters()
        self.optimizer = make_optimizer(self.params, cfg)

    def global_grad_norm(self) -> torch.Tensor:
        """The norm of each shard's runs summed over their own mesh dimensions."""
        return norm_of_groups(self.engine.squared_grad_norms(), self.comms)

    def after_step(self) -> None:
        """Refresh the full parameters from the updated shards (stages 1-2)."""
        self.engine.after_step()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        with self.comms.ledger.in_phase("report"):
            return self.engine.full_state_dict()

    def memory_report(self) -> dict:
        """:func:`memory_report` of the engine's buffers, with the all-gather counts that explain the
        gathered-parameter peak (prefetched ones hold two units at once)."""
        held = self.engine.memory()
        report = memory_report(held["params"], held["grads"], self.optimizer, held["master"],
                               {"gathered_params_peak": held["gathered_params_peak"],
                                "grad_buffers_peak": held["grad_buffers_peak"]})
        report.update({f"{kind}_gathers": count for kind, count in self.engine.gathers.items()})
        return report


def parallelize_sharded(model: nn.Module, parallel: ParallelConfig, train: TrainConfig, comms: Comms,
                        positions: torch.Tensor | None = None) -> Runner:
    """The runner for ``--zero K`` or ``--fsdp STRATEGY`` (flat style). With context parallelism the ranks
    of dp x cp hold different tokens of the same model, so they shard (or replicate) over ``dp_cp``, as
    Megatron's distributed optimizer does; ``positions`` are this rank's sequence positions."""
    from parallelisms.parallel.fsdp import fsdp_plan

    # bf16 compute over fp32 master weights, or the parameters' own dtype (fp32; float64 under verify --dtype)
    dtype = torch.bfloat16 if parallel.mixed_precision == "bf16" else next(model.parameters()).dtype
    plan = zero_plan(parallel.zero, dtype) if parallel.zero else fsdp_plan(parallel.fsdp, dtype)
    if parallel.dims.cp > 1:
        widen = {"dp": "dp_cp"}
        plan = dataclasses.replace(plan, shard_dim=widen.get(plan.shard_dim, plan.shard_dim),
                                   replicate_dim=widen.get(plan.replicate_dim, plan.replicate_dim))
    # ZeRO-1/2 communicate gradients in buckets under --bucket-mb; ZeRO-3 and FSDP per block
    cap = int(train.bucket_mb * 2**20) if parallel.zero in (1, 2) else None
    return ShardedRunner(model, comms, train, plan, module_units(model, cap), positions)
