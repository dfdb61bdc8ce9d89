"""Learning-rate schedules: linear warmup, then constant, cosine (Loshchilov and Hutter 2017, SGDR, without
restarts) or linear decay to ``min_lr`` at the last step, as torch ``LambdaLR`` multipliers of ``--lr``.

The training loop and every single-process reference (``verify``, PipeDream's own) step one scheduler per
optimizer once per training step, so a schedule changes nothing in what ``verify`` compares; with the defaults
(no warmup, constant) the multiplier is exactly 1 and training is bit-identical to a run without a scheduler.
"""

from __future__ import annotations

import math

import torch

from parallelisms.config import TrainConfig
from parallelisms.options import LrSchedule


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The multiplier of ``cfg.lr`` for 0-based ``step``: (step + 1) / warmup during warmup, then the decay
    from 1 to ``min_lr / lr`` over the remaining steps (reached at the last step)."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    if cfg.lr_schedule is LrSchedule.CONSTANT:
        return 1.0
    floor = cfg.min_lr / cfg.lr
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule is LrSchedule.COSINE else 1 - progress
    return floor + (1 - floor) * shape


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` following :func:`lr_factor`; call ``step()`` after each training step.
    Its ``state_dict`` (the step count) is what a checkpoint saves."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step))
