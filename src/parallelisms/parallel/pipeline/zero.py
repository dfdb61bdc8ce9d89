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

import torch
from torch import nn

from parallelisms.comm import Comm
from parallelisms.parallel.common import norm_dims, norm_of_groups, norm_pieces, squared_norms_of_pieces
from parallelisms.parallel.memory import memory_report, tensor_bytes
from parallelisms.parallel.pipeline.runner import PipelineRunner
from parallelisms.train import make_optimizer


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


class ZeroPipelineRunner(PipelineRunner):
    """:class:`PipelineRunner` with optimizer state sharded over ``dp`` (ZeRO-1): gpipe, 1f1b, interleaved
    and the zero-bubble schedules (DualPipe's stage copies and PipeDream's per-microbatch updates are not)."""

    def _grad_buffers(self) -> dict:
        """No all-reduce buckets: the stages' flat buffers are reduce-scattered instead."""
        self.shards = {s: StageShard(list(st.parameters()), self.dp_comm) for s, st in self.stages.items()}
        self.params = [shard.shard for shard in self.shards.values()]
        self.optimizer = make_optimizer(self.params, self.cfg)
        return {}

    def zero_grad(self) -> None:
        for shard in self.shards.values():
            shard.zero_grad()

    def _sync_stage(self, stage: int) -> None:
        self.dp_pending.append(self.shards[stage].reduce_scatter())

    def global_grad_norm(self) -> torch.Tensor:
        """The global norm of the reduced slices."""
        return norm_of_groups(self.squared_grad_norms(), self.comms)

    def after_step(self) -> None:
        """All-gather every rank's updated slices into the stages' flat parameters."""
        for pending in [shard.all_gather() for shard in self.shards.values()]:
            pending.wait()

    def squared_grad_norms(self) -> dict:
        """Squared norms of the reduced slices grouped by the mesh dimensions to sum them over; the groups
        are every key this rank's stages can have (each stage holds blocks, so all ranks have the same)."""
        return squared_norms_of_pieces({dims for shard in self.shards.values() for dims in shard.norm_keys},
                                       ((shard.shard.grad, shard.pieces) for shard in self.shards.values()),
                                       torch.promote_types(next(iter(self.shards.values())).data.dtype, torch.float32))

    def memory_report(self) -> dict:
        """Flat parameter and gradient buffers (padding included) and the 1/N optimizer state."""
        return memory_report(tensor_bytes(s.data for s in self.shards.values()),
                             tensor_bytes(s.grad for s in self.shards.values()), self.optimizer)
