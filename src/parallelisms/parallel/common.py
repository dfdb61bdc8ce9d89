"""What every parallelism shares: marking a parameter as sharded over mesh dimensions, and the global
gradient norm over parameters sharded in any way (an all-reduce of squared norms, never of gradients)."""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comms

SHARD_ATTR = "_parallelisms_sharded_over"


def mark_sharded(param: nn.Parameter, *dims: str) -> nn.Parameter:
    """Record that ``param`` holds a different slice on each rank of the mesh dimensions ``dims``."""
    setattr(param, SHARD_ATTR, tuple(sorted(set(getattr(param, SHARD_ATTR, ())) | set(dims))))
    return param


def sharded_over(param: nn.Parameter) -> tuple[str, ...]:
    return getattr(param, SHARD_ATTR, ())


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
