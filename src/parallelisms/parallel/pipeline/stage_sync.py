"""Data parallelism under pipeline parallelism: the layout's own gradient sync applied to each stage of this rank,
as it applies to a whole model (torchtitan's way: ``parallelize`` wraps each stage as it would wrap the model):
plain local gradients, DDP (:class:`parallelisms.parallel.data.DataParallel`), ZeRO-1/2/3 and the FSDP
strategies (the flat :class:`parallelisms.parallel.flat.ShardedEngine`, per-parameter FSDP2 or YaFSDP's buffer
reuse). No engine knows it runs a stage.

A schedule runs the forwards and backwards of many microbatches interleaved, so :class:`StageSyncs` switches
every stage's engine to :meth:`~parallelisms.parallel.grad_sync.GradSync.hold_through_step` (torch pipelining's
``set_requires_gradient_sync(False)``): gradients accumulate over the step (a sharded engine gathers a unit at its
first forward and keeps it: ZeRO-3 / FULL_SHARD hold the stage's full parameters from the first forward to the
last backward, as torchtitan does with FSDP2 under PP), and right after the stage's last backward (or
weight-gradient) work before an update the executor calls :meth:`StageSyncs.stage_done`, which launches the
engine's reductions (:meth:`~parallelisms.parallel.grad_sync.GradSync.reduce_held`, torch pipelining's REDUCE_GRAD
action) behind the rest of the schedule. Per unit (or bucket) and step that is one all-reduce, or one all-gather
and one reduce-scatter (plus ZeRO-1/2's all-gather of the updated shard after the step), where per-microbatch
regathering would cost 2M all-gathers and M reduce-scatters for M microbatches; the price is that a stage's full
parameters and gradients are live through the step, which the pipeline already bounds to 1/pp of the model
(Megatron's distributed optimizer is the ZeRO-1 case). PipeDream's updates after every microbatch are the same
reduction followed by its update hook (:mod:`parallelisms.parallel.pipeline.pipedream`).

DualPipe (DeepSeek-V3 report) keeps stage ``s`` on ranks ``s`` and ``pp-1-s``: both copies hold the same
layout, so after the reductions the two exchange their reduced gradients and add them, and their optimizers,
fed the same gradient, keep the copies identical. The global norm leaves the second copies out.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.parallel.common import global_grad_norm, norm_of_groups
from parallelisms.parallel.grad_sync import GradSync
from parallelisms.parallel.memory import engines_memory
from parallelisms.parallel.pipeline.stage import add_mirror_copies


class StageSyncs:
    """The pipeline's ``GradSync``: one engine per stage of this rank (``engines``: stage index -> the layout's
    gradient sync over that stage), held through the step; DualPipe's second ``copies`` among them."""

    def __init__(self, engines: dict[int, GradSync], copies: set[int], comms: Comms):
        self.engines, self.copies, self.comms = engines, copies, comms
        for engine in engines.values():
            engine.hold_through_step()

    def parameters(self) -> list[nn.Parameter]:
        return [p for engine in self.engines.values() for p in engine.parameters()]

    def zero_grad(self) -> None:
        for engine in self.engines.values():
            engine.zero_grad()

    def no_sync(self):
        raise RuntimeError("a pipeline stage's gradients are reduced once per step, after its last backward")

    def stage_done(self, stage: int) -> None:
        """The executor's hook after the stage's last backward work before an update: launch its reductions."""
        self.engines[stage].reduce_held()

    def remove(self) -> None:
        for engine in self.engines.values():
            engine.remove()

    def finish(self) -> None:
        for engine in self.engines.values():
            engine.finish()
        if self.copies:
            add_mirror_copies(self.comms["pp"], [_grad_of(p) for s in sorted(self.engines)
                                                 for p in self.engines[s].parameters()])

    def finish_stage(self, stage: int) -> None:
        """PipeDream's update of ``stage``: wait for the reduction launched after its microbatch's backward."""
        self.engines[stage].finish()

    def stage_grad_norm(self, stage: int, params: list[nn.Parameter]) -> torch.Tensor:
        """PipeDream's per-stage norm of ``params`` (the stage's): its replicas agree, so summed over tp and ep
        only, not over the other stages (which update at other times)."""
        return global_grad_norm(params, self.comms, within=("tp", "ep"))

    def grad_norm(self) -> torch.Tensor:
        """The global norm: the stages' squared norms by mesh-dimension group (stages are marked sharded over
        ``pp``), second copies left out; every stage holds blocks, so every rank has the same groups."""
        groups: dict = {}
        for s, engine in self.engines.items():
            if s not in self.copies:
                for dims, sq in engine.squared_grad_norms().items():
                    groups[dims] = groups[dims] + sq if dims in groups else sq
        return norm_of_groups(groups, self.comms)

    def after_step(self) -> None:
        for engine in self.engines.values():
            engine.after_step()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages (first copies), full over every dimension but the pipeline's; a collective."""
        return {name: t for s, engine in self.engines.items() if s not in self.copies
                for name, t in engine.full_state_dict().items()}

    def memory(self, optimizers) -> dict:
        return engines_memory(list(self.engines.values()), optimizers)

    def placements(self) -> list:
        """Every stage's engine's (DualPipe's second copies too: they load the same boxes)."""
        return [entry for engine in self.engines.values() for entry in engine.placements()]


def _grad_of(param: nn.Parameter) -> torch.Tensor:
    """``param``'s gradient, a zero one where none arrived (both copies then exchange the same tensors)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad
