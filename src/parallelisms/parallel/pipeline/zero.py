"""ZeRO-1 under pipeline parallelism (Megatron-LM's distributed optimizer, as torchtitan runs it with PP).

Each stage's parameters and gradients live in two flat buffers padded to a multiple of the data-parallel
size N (the parameters stay the modules' own leaf tensors, their ``.data`` and ``.grad`` are views, so the
executor, split backward and tensor-parallel layers run unchanged). Where the plain runner all-reduces a
stage's gradient buffer, this one reduce-scatters it (asynchronously, right after the stage's last
weight-gradient work); AdamW keeps fp32 state for this rank's 1/N slice only and steps it in place, and an
all-gather refreshes the stage's flat parameters. Traffic per stage: (N-1)/N x G twice, the all-reduce's.

Clipping uses the global norm of the reduced slices: each parameter's piece of the slice is summed over
``dp`` and the dimensions the parameter is sharded on (``pp``; ``tp`` for tensor-parallel shards, not for
replicated norm weights), every rank reducing the same groups in the same order.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from torch import nn

from parallelisms.comm import Comm, Comms
from parallelisms.parallel.common import gather_full, norm_dims, norm_of_groups, norm_pieces, squared_norms_of_pieces
from parallelisms.parallel.memory import memory_report, tensor_bytes


class StageShard:
    """One stage's parameters and gradients as padded flat buffers (``data``, ``grad``) that the parameters
    view, and this rank's 1/N slice ``shard`` of ``data`` (an ``nn.Parameter``; its ``.grad`` is the same
    slice of ``grad``, which the reduce-scatter fills)."""

    def __init__(self, params: list[nn.Parameter], comm: Comm):
        self.params, self.comm = params, comm
        numels = [p.numel() for p in params]
        shard_numel = math.ceil(sum(numels) / comm.size)
        self.data = torch.zeros(shard_numel * comm.size, dtype=params[0].dtype, device=params[0].device)
        self.grad = torch.zeros_like(self.data)
        self.lo, self.hi = comm.rank * shard_numel, (comm.rank + 1) * shard_numel
        self.grad_views, offset = [], 0
        for p, numel in zip(params, numels):
            self.data[offset:offset + numel].copy_(p.detach().reshape(-1))
            p.data = self.data[offset:offset + numel].view_as(p)
            self.grad_views.append(self.grad[offset:offset + numel].view_as(p))
            offset += numel
        self.shard = nn.Parameter(self.data[self.lo:self.hi])
        # gradient-norm groups of the shard: dp and pp, plus tp for tensor-parallel shards
        self.norm_keys = {norm_dims(p, (comm.name,)) for p in params}
        self.pieces = norm_pieces(params, self.lo, self.hi, (comm.name,))

    def zero_grad(self) -> None:
        self.grad.zero_()
        for p, view in zip(self.params, self.grad_views):
            p.grad = view
        self.shard.grad = self.grad[self.lo:self.hi]

    def reduce_scatter(self):
        """Launch the average of the gradient over the group; this rank's slice lands in ``shard.grad``."""
        self.grad.div_(self.comm.size)
        return self.comm.reduce_scatter(self.grad, out=self.shard.grad, scratch=True, async_op=True)

    def all_gather(self):
        """Launch the refresh of ``data`` from every rank's updated slice."""
        return self.comm.all_gather(self.shard.detach(), out=self.data, async_op=True)


class StageShards:
    """The pipeline's ``GradSync`` under ZeRO-1 (Megatron's distributed optimizer): one :class:`StageShard`
    per stage of this rank; the optimizer holds the shards' slices. gpipe, 1f1b, interleaved and the
    zero-bubble schedules (DualPipe's stage copies and PipeDream's per-microbatch updates are not)."""

    def __init__(self, stages: dict[int, nn.Module], comms: Comms, data_dim: str = "dp"):
        self.stages, self.comms = stages, comms
        self.shards = {s: StageShard(list(st.parameters()), comms[data_dim]) for s, st in stages.items()}
        self.pending: list = []

    def parameters(self) -> list[nn.Parameter]:
        return [shard.shard for shard in self.shards.values()]

    def zero_grad(self) -> None:
        for shard in self.shards.values():
            shard.zero_grad()

    def no_sync(self):
        return nullcontext()

    def stage_done(self, stage: int) -> None:
        self.pending.append(self.shards[stage].reduce_scatter())

    def finish(self) -> None:
        for pending in self.pending:
            pending.wait()
        self.pending = []

    def grad_norm(self) -> torch.Tensor:
        """The global norm of the reduced slices, grouped by the mesh dimensions to sum them over; the groups
        are every key this rank's stages can have (each stage holds blocks, so all ranks have the same)."""
        return norm_of_groups(squared_norms_of_pieces(
            {dims for shard in self.shards.values() for dims in shard.norm_keys},
            ((shard.shard.grad, shard.pieces) for shard in self.shards.values()),
            torch.promote_types(next(iter(self.shards.values())).data.dtype, torch.float32)), self.comms)

    def after_step(self) -> None:
        """All-gather every rank's updated slices into the stages' flat parameters."""
        for pending in [shard.all_gather() for shard in self.shards.values()]:
            pending.wait()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages, tensor-parallel shards gathered (the flat buffers hold full parameters)."""
        return {name: gather_full(p, self.comms).cpu().clone() for st in self.stages.values()
                for name, p in st.named_parameters()}

    def memory(self, optimizers) -> dict:
        """Flat parameter and gradient buffers (padding included) and the 1/N optimizer state."""
        return memory_report(tensor_bytes(s.data for s in self.shards.values()),
                             tensor_bytes(s.grad for s in self.shards.values()), optimizers)
