"""What every parallelism shares: marking a parameter as sharded over mesh dimensions (and how to
reassemble it), the global gradient norm over parameters sharded in any way (an all-reduce of
squared norms, never of gradients), and the backward prefetch point of the sharded engines."""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comms

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


def after_last_child_backward(module: nn.Module, callback):
    """Call ``callback()`` in backward once the gradient of the input of ``module``'s last registered child
    (a block's MLP) is complete, that is, after that child's backward. The sharded engines prefetch the
    previous unit's parameters there: the gather overlaps the rest of the block's backward (attention)
    without being held on top of the activations the MLP's backward frees, where backward memory peaks.
    Returns the hook handle, or None when ``module`` has fewer than two children."""
    children = list(module.children())
    if len(children) < 2:
        return None

    def on_input_grad(grad) -> None:  # leaves the gradient unchanged
        callback()

    def hook(child, args):
        if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(on_input_grad)
    return children[-1].register_forward_pre_hook(hook)


def gather_full(param: torch.Tensor, comms: Comms) -> torch.Tensor:
    """Reassemble a parameter marked with :func:`mark_sharded` (all ranks of its dimensions take part)."""
    full = param.detach()
    for mesh_dim, tensor_dim, full_size in reversed(getattr(param, SHARD_ATTR, ())):
        if tensor_dim is None:
            continue
        full = comms[mesh_dim].all_gather(full.contiguous(), dim=tensor_dim)
        if full_size is not None:
            full = full.narrow(tensor_dim, 0, full_size)
    return full


def global_grad_norm(params, comms: Comms, grads=None) -> torch.Tensor:
    """The L2 norm of the full model's gradient. Parameters sharded over dimensions D contribute their local
    squared norm summed over D; replicated ones count once. ``grads`` overrides ``p.grad`` (sharded grads)."""
    params = list(params)
    grads = [p.grad for p in params] if grads is None else list(grads)
    groups: dict[tuple[str, ...], torch.Tensor] = {}
    for p, g in zip(params, grads):
        if g is None:
            continue
        key = sharded_over(p)
        sq = g.detach().float().pow(2).sum()
        groups[key] = groups[key] + sq if key in groups else sq
    total = torch.zeros((), dtype=torch.float32)
    for dims, sq in sorted(groups.items()):
        for dim in dims:
            sq = comms[dim].all_reduce(sq.reshape(1)).reshape(())
        total = total + sq.cpu()
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, comms: Comms, grads=None) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``)."""
    params = list(params)
    grads = [p.grad for p in params] if grads is None else list(grads)
    norm = global_grad_norm(params, comms, grads)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        if g is not None:
            g.mul_(coef.to(g.device, g.dtype))
    return norm
