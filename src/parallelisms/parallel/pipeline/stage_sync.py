"""Sharded data parallelism under pipeline parallelism: ZeRO-1/2/3 and the FSDP strategies for the stages of
this rank, each stage one sharding engine held through the step: the flat engine
(:class:`parallelisms.parallel.flat.ShardedEngine`), the per-parameter one (FSDP2,
:class:`parallelisms.parallel.fsdp2.PerParamSharding`) or buffer reuse (YaFSDP,
:class:`parallelisms.parallel.yafsdp.ReuseSharding`), the same engines plain training uses.

A schedule runs the forwards and backwards of many microbatches interleaved, so each stage's engine gathers a
unit at its first forward of the step and keeps it (ZeRO-3 / FULL_SHARD hold the stage's full parameters
from the first forward to the last backward, as torchtitan does with FSDP2 under PP), the gradient
accumulates in full over the microbatches, and right after the stage's last backward (or weight-gradient)
work of the step the executor calls :meth:`StageSharding.stage_done`: every unit is reduce-scattered and
freed, behind the rest of the schedule. Per unit and step that is one all-gather and one reduce-scatter (plus
ZeRO-1/2's all-gather of the updated shard after the step) where per-microbatch regathering would cost 2M
all-gathers and M reduce-scatters for M microbatches; the price is that a stage's full parameters and
gradients are live through the step, which the pipeline already bounds to 1/pp of the model (Megatron's
distributed optimizer is the ZeRO-1 case).

An engine here provides ``parameters``, ``zero_grad``, ``reduce_held``, ``finish``, ``squared_grad_norms``,
``after_step``, ``full_state_dict``, and ``held_bytes``/``counts`` for
:func:`parallelisms.parallel.memory.engines_memory`.

DualPipe (DeepSeek-V3 report) keeps stage ``s`` on ranks ``s`` and ``pp-1-s``: both copies hold the same
layout, so after the reductions the two exchange their reduced gradient shards and add them, and
their optimizers, fed the same gradient, keep the copies identical. The global norm leaves the second
copies out.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.parallel.common import norm_of_groups
from parallelisms.parallel.flat import ShardedEngine
from parallelisms.parallel.fsdp2 import PerParamSharding
from parallelisms.parallel.memory import engines_memory
from parallelisms.parallel.pipeline.stage import add_mirror_copies


class StageSharding:
    """The pipeline's ``GradSync`` for sharded data parallelism: one held engine per stage of this rank
    (``engines``: stage index -> flat, per-parameter or buffer-reuse engine), DualPipe's second ``copies``
    among them."""

    def __init__(self, engines: dict[int, ShardedEngine | PerParamSharding], copies: set[int], comms: Comms):
        self.engines, self.copies, self.comms = engines, copies, comms
        assert all(engine.hold for engine in engines.values()), "stages reduce once per step: hold_through_step"

    def parameters(self) -> list[nn.Parameter]:
        return [p for engine in self.engines.values() for p in engine.parameters()]

    def zero_grad(self) -> None:
        for engine in self.engines.values():
            engine.zero_grad()

    def no_sync(self):
        raise RuntimeError("a pipeline stage's gradients are reduced once per step, after its last backward")

    def stage_done(self, stage: int) -> None:
        """The executor's hook after the stage's last backward work of the step: launch its reductions."""
        self.engines[stage].reduce_held()

    def remove(self) -> None:
        for engine in self.engines.values():
            engine.remove()

    def finish(self) -> None:
        for engine in self.engines.values():
            engine.finish()
        if self.copies:
            add_mirror_copies(self.comms["pp"], [p.grad for s in sorted(self.engines)
                                                 for p in self.engines[s].parameters()])

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
