"""The optimizer every layout steps: AdamW over whatever parameters the gradient synchronisation exposes
(full parameters, flat shards or per-parameter shards alike), and which of their elements weight decay applies to.

Settings (``TrainConfig``): ``lr``, ``betas`` (default 0.9, 0.95), ``eps`` (1e-8) and ``weight_decay`` (0.01).
Decay applies to the weight matrices only: not to 1-D parameters (norms, biases) nor to the embedding table (tied
to the output head or not), as Megatron-LM's ``no_weight_decay_cond`` and nanoGPT's ``configure_optimizers`` group
them; ``decay_all`` decays every parameter. A parameter is judged by its plain-model name and full shape, so a
flat shard of the ZeRO/FSDP1 engine or of buffer reuse that holds matrices and norms side by side decays only the
runs of its elements that are matrices (:class:`AdamW`'s ``decay_runs``), and every layout computes the update
single-process AdamW with the same two parameter groups computes.
"""

from __future__ import annotations

import math

import torch

from parallelisms.config import TrainConfig

EMBEDDING = "tok_embeddings.weight"


def decays(name: str, ndim: int, cfg: TrainConfig, tied: bool = False) -> bool:
    """Whether weight decay applies to the plain model's parameter ``name`` of ``ndim`` dimensions; ``tied``:
    the output head is a copy of the embedding (``tie_embeddings``) and is judged as the embedding."""
    if cfg.decay_all:
        return True
    embedding = name == EMBEDDING or (tied and name == "output.weight")
    return ndim >= 2 and not embedding


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW``; a parameter group with ``decay_runs`` (one list of ``(lo, hi)`` element runs per
    parameter, torch's ``weight_decay`` 0 in the group) first multiplies only those runs of each parameter by
    ``1 - lr * run_decay``, the decoupled decay AdamW applies to a whole parameter before its update."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p, runs in zip(group["params"], group.get("decay_runs", ())):
                if p.grad is not None:
                    flat = p.view(-1)
                    for lo, hi in runs:
                        flat[lo:hi].mul_(1 - group["lr"] * group["run_decay"])
        return super().step(closure)


def _adamw(cfg: TrainConfig, decay: list, keep: list, mixed: list = (), runs: list = ()) -> AdamW:
    """Always the same three groups, some possibly empty (decayed, not decayed, decayed by runs), so that every
    layout's optimizer and learning-rate schedule have the same groups (a checkpoint's schedule loads into any)."""
    return AdamW([{"params": decay}, {"params": keep, "weight_decay": 0.0},
                  {"params": list(mixed), "decay_runs": list(runs), "weight_decay": 0.0, "run_decay": cfg.weight_decay}],
                 lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def make_optimizer(params, cfg: TrainConfig, tied: bool = False) -> AdamW:
    """AdamW (Loshchilov and Hutter 2019) with the run's settings over ``params``: ``(name, parameter)`` pairs of
    whole parameters, decayed or not by :func:`decays`; bare parameters all decay."""
    params = list(params)
    if not params or not isinstance(params[0], tuple):
        return _adamw(cfg, params, [])
    chosen = [decays(name, p.dim(), cfg, tied) for name, p in params]
    return _adamw(cfg, [p for (_, p), d in zip(params, chosen) if d], [p for (_, p), d in zip(params, chosen) if not d])


def sharded_optimizer(placements, cfg: TrainConfig, tied: bool = False) -> AdamW:
    """AdamW over a gradient sync's optimizer parameters, each given with the pieces of the plain model's
    parameters it holds (``GradSync.placements``): a parameter whose pieces all decay or none in the first two
    groups, one holding both kinds (a flat shard) in a third that decays the runs of its decayed pieces."""
    decay, keep, mixed, mixed_runs = [], [], [], []
    for param, pieces in placements:
        runs = [(pc.flat_lo, pc.flat_lo + math.prod(pc.box_shape)) for pc in pieces
                if decays(pc.name, len(pc.full_shape), cfg, tied)]
        if pieces and len(runs) == len(pieces):
            decay.append(param)
        elif not runs:
            keep.append(param)
        else:
            mixed.append(param)
            mixed_runs.append(_merged(runs))
    return _adamw(cfg, decay, keep, mixed, mixed_runs)


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):
        if out and out[-1][1] >= lo:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
