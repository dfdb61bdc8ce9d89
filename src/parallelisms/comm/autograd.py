"""Autograd-aware collectives over a :class:`~parallelisms.comm.ops.Comm`: the conjugate pairs of Megatron-LM
(Shoeybi et al. 2019) and its sequence parallelism (Korthikanti et al. 2023): identity/all-reduce,
all-reduce/identity, all-gather/reduce-scatter, reduce-scatter/all-gather, split/all-gather, and
all-to-all/all-to-all. Each goes through the Comm, so both passes are accounted."""

from __future__ import annotations

import torch

from parallelisms.comm.ops import Comm


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad.contiguous().clone()), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, backward_reduce):
        ctx.comm, ctx.dim, ctx.backward_reduce = comm, dim, backward_reduce
        return comm.all_gather(x, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_reduce:
            return ctx.comm.reduce_scatter(grad, dim=ctx.dim), None, None, None
        return grad.chunk(ctx.comm.size, dim=ctx.dim)[ctx.comm.rank].contiguous(), None, None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return comm.reduce_scatter(x, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, dim=ctx.dim), None, None


class _SplitAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return x.chunk(comm.size, dim=dim)[comm.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, dim=ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, output_splits, input_splits, between=None, backward_comm=None):
        ctx.comm, ctx.output_splits, ctx.input_splits = backward_comm or comm, output_splits, input_splits
        if between is None:
            return comm.all_to_all(x, output_splits, input_splits)
        pending = comm.all_to_all(x, output_splits, input_splits, async_op=True)
        between()  # other work while the all-to-all is in flight
        return pending.wait()

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_to_all(grad, ctx.input_splits, ctx.output_splits), None, None, None, None, None


def copy_to_group(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (Megatron's f; input of column-parallel)."""
    return x if comm.size == 1 else _CopyToGroup.apply(x, comm)


def reduce_from_group(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-reduce forward, identity backward (Megatron's g; output of row-parallel)."""
    return x if comm.size == 1 else _ReduceFromGroup.apply(x, comm)


def gather_along(x: torch.Tensor, comm: Comm, dim: int, backward: str = "reduce_scatter") -> torch.Tensor:
    """All-gather along ``dim``; backward reduce-scatters (sequence parallel) or takes the local slice ("split")."""
    return x if comm.size == 1 else _GatherAlong.apply(x, comm, dim, backward == "reduce_scatter")


def reduce_scatter_along(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """Reduce-scatter along ``dim`` forward, all-gather backward (sequence-parallel row output)."""
    return x if comm.size == 1 else _ReduceScatterAlong.apply(x, comm, dim)


def split_along(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """Keep this rank's slice along ``dim`` forward, all-gather backward."""
    return x if comm.size == 1 else _SplitAlong.apply(x, comm, dim)


def all_to_all(x: torch.Tensor, comm: Comm, output_splits=None, input_splits=None, between=None,
               backward_comm: Comm | None = None) -> torch.Tensor:
    """All-to-all over dim 0 forward; the reverse all-to-all backward (Ulysses, expert dispatch/combine), over
    ``backward_comm`` if given (the same ranks, another group). ``between()``, if given, runs while the forward
    all-to-all is in flight (DualPipe's F&B overlap)."""
    if comm.size == 1:
        if between is not None:
            between()
        return x
    return _AllToAll.apply(x, comm, output_splits, input_splits, between, backward_comm)
