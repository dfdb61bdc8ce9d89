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
from torch import nn

from parallelisms.config import ModelConfig, TrainConfig
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.model import build_model

TOLERANCE = 1e-5
# bf16 training against a bf16 reference whose arithmetic differs in order: both round the same weights and
# activations to bf16 (unit roundoff 2^-8), but one bf16 gradient of the whole batch differs from per-rank bf16
# gradients summed in fp32 (and a clip norm summed in another order moves the clip factor by an ulp, which flips
# the bf16 rounding of a few weights); Adam turns such roundings into sign-level updates where the gradient is
# near zero. Measured at dp 2 after 3 steps: 1.3e-5 on losses, 6.6e-3 on the worst parameter tensor, while
# fp32 training is 2.3e-2 away, so 1e-2 still tells bf16 from fp32 (it grows with the number of partial
# gradients: 1.3e-2 at dp 4). With the same arithmetic (reference_train_bf16(splits=dp), no clipping) runs
# are bit-exact and the 1e-5 contract holds.
BF16_TOLERANCE = 1e-2


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


def reference_train_bf16(model_cfg: ModelConfig, cfg: TrainConfig, splits: int = 1):
    """Single-process mixed precision: bf16 weights and compute, fp32 master weights, gradients and AdamW.

    ``splits`` > 1 takes the bf16 gradient of each data-parallel rank's rows separately and sums them in
    fp32 divided by ``splits``: the arithmetic of an N-rank run, done in one process."""
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, cfg.seed)
    names = [n for n, _ in model.named_parameters()]
    compute = list(model.parameters())
    master = [nn.Parameter(p.detach().clone()) for p in compute]
    for p in compute:
        p.data = p.data.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(master, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=1e-8)
    loader = BatchLoader(load_corpus(), cfg.global_batch, cfg.seq_len, cfg.seed)
    losses = []
    for step in range(cfg.steps):
        for m in master:
            m.grad = torch.zeros_like(m)
        loss = 0.0
        for rank in range(splits):
            model.zero_grad(set_to_none=True)
            part = model(*loader.shard(step, rank, splits))
            part.backward()
            loss += part.item() / splits
            for m, p in zip(master, compute):
                m.grad += p.grad.float() / splits
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(master, cfg.grad_clip)
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(master, compute):
                p.copy_(m)
        losses.append(loss)
    return losses, {n: m.detach().clone() for n, m in zip(names, master)}


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
