"""Equivalence check: a layout against plain single-process training on the same seed and data.

The reference is deliberately independent of the parallel code: the plain model on the whole global
batch, ``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``. Relative differences:
losses |l - l_ref| / |l_ref| per step; parameters ||p - p_ref||_2 / ||p_ref||_2 per tensor. The contract
is 1e-5 in fp32. The tensor norm, not the worst element, because Adam divides each element's update by
that element's own gradient scale: an entry whose gradient is a near-cancellation of large terms (so
its fp32 rounding depends on summation order) moves by up to ~lr in either layout, which the
elementwise maximum reports (about 3e-5 of the largest entry after 5 steps at lr 3e-3 here) while the
tensor as a whole agrees to about 4e-6. ``max_param_abs_diff`` reports the worst element too.
"""

from __future__ import annotations

import torch

from parallelisms.config import ModelConfig, TrainConfig
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.model import build_model

TOLERANCE = 1e-5


def reference_train(model_cfg: ModelConfig, train_cfg: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training: per-step losses and the final parameters."""
    torch.manual_seed(train_cfg.seed)
    model = build_model(model_cfg, train_cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, betas=train_cfg.betas,
                                  weight_decay=train_cfg.weight_decay, eps=1e-8)
    loader = BatchLoader(load_corpus(), train_cfg.global_batch, train_cfg.seq_len, train_cfg.seed)
    losses = []
    for step in range(train_cfg.steps):
        inputs, targets = loader.batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = model(inputs, targets)
        loss.backward()
        if train_cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def compare(losses: list[float], state: dict[str, torch.Tensor], ref_losses: list[float],
            ref_state: dict[str, torch.Tensor], tolerance: float = TOLERANCE) -> dict:
    """Maximum relative differences of losses and parameters, and whether both are within ``tolerance``."""
    if set(state) != set(ref_state):
        raise ValueError(f"parameter names differ: {sorted(set(state) ^ set(ref_state))[:5]}")
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    worst_name, param_diff, abs_diff = "", 0.0, 0.0
    for name, ref in ref_state.items():
        got = state[name].to(ref.dtype)
        if got.shape != ref.shape:
            raise ValueError(f"parameter {name} has shape {tuple(got.shape)}, reference {tuple(ref.shape)}")
        diff = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        abs_diff = max(abs_diff, (got - ref).abs().max().item())
        if diff > param_diff:
            worst_name, param_diff = name, diff
    return {"max_loss_rel_diff": loss_diff, "max_param_rel_diff": param_diff, "worst_param": worst_name,
            "max_param_abs_diff": abs_diff, "tolerance": tolerance,
            "ok": loss_diff <= tolerance and param_diff <= tolerance}
