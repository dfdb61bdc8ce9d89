"""What every parallelism shares: marking a parameter as sharded over mesh dimensions (and how to
reassemble it), the global gradient norm over parameters sharded in any way (an all-reduce of
squared norms, never of gradients), and the backward prefetch point of the sharded engines."""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.model.numerics import upcast

SHARD_ATTR = "_parallelisms_shards"


def mark_sharded(param: nn.Parameter, mesh_dim: str, tensor_dim: int | None = 0,
                 full_size: int | None = None) -> nn.Parameter:
    """Record that ``param`` holds a different slice on each rank of mesh dimension ``mesh_dim``: an equal
    chunk along ``tensor_dim`` of a tensor whose size there is ``full_size`` (trailing padding beyond it is
    dropped when reassembling). ``tensor_dim=None`` marks a parameter that is sharded but not reassembled
    by concatenation (the owner gathers it). Several calls record sharding over several dimensions,
    innermost last."""
    shards = getattr(param, SHARD_ATTR, ())
    setattr(param, SHARD_ATTR, shards + ((mesh_dim, tensor_dim, full_size),))
    return param


def sharded_over(param: nn.Parameter) -> tuple[str, ...]:
    """Mesh dimensions over which ``param`` differs between ranks."""
    return tuple(sorted({dim for dim, _, _ in getattr(param, SHARD_ATTR, ())}))


def after_last_child_backward(modules: list[nn.Module], callback):
    """Call ``callback()`` in backward once the gradient of the input of the last registered child of a
    sharding unit's one module (a block's MLP) is complete, that is, after that child's backward. The
    sharded engines prefetch the previous unit's parameters there: the gather overlaps the rest of the
    block's backward (attention) without being held on top of the activations the MLP's backward frees,
    where backward memory peaks. Returns the hook handle, or None for a unit of several modules or of a
    module with fewer than two children (the engines then prefetch when the unit's backward starts)."""
    children = list(modules[0].children()) if len(modules) == 1 else []
    if len(children) < 2:
        return None

    def on_input_grad(grad) -> None:  # leaves the gradient unchanged
        callback()

    def hook(child, args):
        if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(on_input_grad)
    return children[-1].register_forward_pre_hook(hook)


def gather_full(param: torch.Tensor, comms: Comms, marks=None) -> torch.Tensor:
    """Reassemble a parameter marked with :func:`mark_sharded` (all ranks of its dimensions take part);
    ``marks`` gives the marks of a tensor that does not carry them (a piece of a flat buffer)."""
    full = param.detach()
    for mesh_dim, tensor_dim, full_size in reversed(getattr(param, SHARD_ATTR, ()) if marks is None else marks):
        if tensor_dim is None:
            continue
        full = comms[mesh_dim].all_gather(full.contiguous(), dim=tensor_dim)
        if full_size is not None:
            full = full.narrow(tensor_dim, 0, full_size)
    return full


def add_squared_norm(groups: dict, dims: tuple[str, ...], grad: torch.Tensor) -> None:
    """Add ``grad``'s squared L2 norm to ``groups[dims]``: the gradient is sharded over mesh ``dims``."""
    sq = upcast(grad.detach()).pow(2).sum()
    groups[dims] = groups[dims] + sq if dims in groups else sq


def norm_dims(param: torch.Tensor, shard_dims: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The mesh dimensions over which ``param``'s squared gradient norm is summed: those it is marked
    sharded on, plus ``shard_dims`` (a flat buffer's own sharding)."""
    return tuple(sorted(set(sharded_over(param)) | set(shard_dims)))


def norm_pieces(params, lo: int, hi: int, shard_dims: tuple[str, ...]) -> list[tuple[tuple[str, ...], int, int]]:
    """For ``params`` laid out back to back in a flat buffer, the runs of its slice ``[lo, hi)`` whose
    parameters have the same :func:`norm_dims`, as (dimensions, start, end) relative to ``lo``."""
    pieces, offset = [], 0
    for p in params:
        start, end = max(offset, lo) - lo, min(offset + p.numel(), hi) - lo
        if start < end:
            dims = norm_dims(p, shard_dims)
            if pieces and pieces[-1][0] == dims and pieces[-1][2] == start:
                pieces[-1] = (dims, pieces[-1][1], end)
            else:
                pieces.append((dims, start, end))
        offset += p.numel()
    return pieces


def squared_norms_of_pieces(keys, sliced, dtype: torch.dtype) -> dict:
    """Squared gradient norms grouped by mesh dimensions, from ``sliced``: (flat gradient slice or None,
    its :func:`norm_pieces`) pairs. ``keys`` holds every group any rank can have, so that all ranks
    reduce the same groups in the same order; a group this rank holds nothing of is a zero of ``dtype``
    (the gradients' reduction dtype: every rank must all-reduce the same dtype)."""
    groups = {dims: torch.zeros((), dtype=dtype) for dims in keys}
    for grad, pieces in sliced:
        if grad is not None:
            for dims, start, end in pieces:
                add_squared_norm(groups, dims, grad[start:end])
    return groups


def norm_of_groups(groups: dict, comms: Comms) -> torch.Tensor:
    """The global L2 norm from squared norms grouped by the mesh dimensions they are sharded over: each
    group summed over its dimensions (an all-reduce of one number), replicated parts counted once."""
    total = torch.zeros((), dtype=torch.float32)
    for dims, sq in sorted(groups.items()):
        for dim in dims:
            sq = comms[dim].all_reduce(sq.reshape(1)).reshape(())
        total = total.to(sq.dtype) + sq.cpu()  # float64 gradients keep a float64 norm
    return total.sqrt()


def global_grad_norm(params, comms: Comms, grads=None, within: tuple[str, ...] | None = None) -> torch.Tensor:
    """The L2 norm of the full model's gradient. Parameters sharded over dimensions D contribute their local
    squared norm summed over D; replicated ones count once. ``grads`` overrides ``p.grad`` (sharded grads).
    ``within`` names the only mesh dimensions summed over: the norm of the part of the model those ranks
    hold together (PipeDream's per-stage norm sums over ``("tp",)`` only, not over the other stages)."""
    params = list(params)
    grads = [p.grad for p in params] if grads is None else list(grads)
    groups: dict[tuple[str, ...], torch.Tensor] = {}
    for p, g in zip(params, grads):
        if g is not None:
            dims = sharded_over(p)
            add_squared_norm(groups, dims if within is None else tuple(d for d in dims if d in within), g)
    return norm_of_groups(groups, comms)


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, comms: Comms, grads=None, norm=None,
                    within: tuple[str, ...] | None = None) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``);
    ``norm``, when given, is that global norm computed by the caller; ``within`` as for
    :func:`global_grad_norm`."""
    params = list(params)
    grads = [p.grad for p in params] if grads is None else list(grads)
    norm = global_grad_norm(params, comms, grads, within) if norm is None else norm
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        if g is not None:
            g.mul_(coef.to(g.device, g.dtype))
    return norm
