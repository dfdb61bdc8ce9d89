"""The optimizer every layout steps: AdamW over whatever parameters the gradient synchronisation exposes
(full parameters, flat shards or per-parameter shards alike)."""

from __future__ import annotations

import torch

from parallelisms.config import TrainConfig


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (Loshchilov and Hutter 2019) with the run's learning rate, betas and weight decay."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=1e-8)
