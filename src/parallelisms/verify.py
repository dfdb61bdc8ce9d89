"""Equivalence check: a layout against plain single-process training on the same seed and data.

The reference is deliberately independent of the parallel code: the plain model, ``torch.optim.AdamW`` and
global-norm clipping with the norm summed in float64 (:func:`clip_grad_norm_float64`). It accumulates the
gradient over the same equal slices of the global batch that the layout averages (data-parallel ranks x
microbatches), so what remains is the parallel arithmetic itself. Relative differences: losses
|l - l_ref| / |l_ref| per step; parameters ||p - p_ref||_2 / ||p_ref||_2 per tensor; the contract is 1e-5
in fp32. Measured here the layouts land near 1e-7. Two effects that are not a layout's error would
otherwise hide that margin: Adam divides each element's update by that element's own gradient scale, so
summing per-sample gradients in another order already moves a tensor by up to 1.5e-5 at lr 3e-3 (it scales
with lr); and torch's fp32 CPU ``vector_norm`` (inside ``torch.nn.utils.clip_grad_norm_``) was 4e-4 off on
an 8192 x 64 gradient, which moves the clip factor. The tensor norm rather than the worst element, because
an element whose gradient is a near-cancellation moves by up to ~lr in either order;
``max_param_abs_diff`` reports the worst element too.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.config import ModelConfig, TrainConfig
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.model import build_model

TOLERANCE = 1e-5
# bf16 training against the plain bf16 reference (one bf16 gradient of the whole batch rather than per-rank
# bf16 gradients summed in fp32): both round the same weights and activations to bf16 (unit roundoff 2^-8),
# and Adam turns the different gradient roundings into sign-level updates where a gradient is near zero.
# Measured at dp 2 after 3 steps: 1.3e-5 on losses, 6.6e-3 on the worst parameter tensor, while fp32 training
# is 2.3e-2 away, so 1e-2 still tells bf16 from fp32 (it grows with the number of partial gradients: 1.3e-2 at
# dp 4). Against the same arithmetic (reference_train_bf16(splits=dp)), which `verify` uses, runs agree to
# about 1e-8 and the 1e-5 contract holds.
BF16_TOLERANCE = 1e-2


@torch.no_grad()
def clip_grad_norm_float64(params, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm accumulated in float64.

    torch's fp32 ``vector_norm`` on the CPU loses accuracy on large tensors: on an 8192 x 64 output-layer
    gradient it was 4e-4 relative below the float64 value, enough to move the clip factor and, through
    Adam, parameters by 2e-5. The parallel runs sum fp32 squares with ``torch.sum`` (pairwise, within 1e-7
    of float64), so the reference must be at least as accurate for the comparison to test the layout.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


def _train_reference(cfg: TrainConfig, params: list, accumulate, after_step=lambda: None) -> list[float]:
    """The loop both references share: ``accumulate(loader, step)`` leaves the step's gradient in
    ``params[i].grad`` and returns the loss; then clipping and AdamW over ``params``."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=1e-8)
    loader = BatchLoader(load_corpus(), cfg.global_batch, cfg.seq_len, cfg.seed)
    losses = []
    for step in range(cfg.steps):
        losses.append(accumulate(loader, step))
        if cfg.grad_clip > 0:
            clip_grad_norm_float64(params, cfg.grad_clip)
        optimizer.step()
        after_step()
    return losses


def reference_train(model_cfg: ModelConfig, train_cfg: TrainConfig,
                    splits: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training: per-step losses and the final parameters.

    ``splits`` > 1 accumulates the gradient over that many equal slices of the global batch (plain gradient
    accumulation), the summation order of a layout that divides the batch over ranks and microbatches.
    ``verify`` uses it so that what remains is the parallel arithmetic alone: with Adam, the order in which
    per-sample gradients are summed already moves a tensor by up to ~1.5e-5 (``small`` preset, lr 3e-3, 4
    slices against 1), which is rounding, not a layout's error, and scales with lr.
    """
    torch.manual_seed(train_cfg.seed)
    model = build_model(model_cfg, train_cfg.seed)

    def accumulate(loader, step):
        model.zero_grad(set_to_none=True)
        loss = 0.0
        for piece in range(splits):
            part = model(*loader.shard(step, piece, splits)) / splits
            part.backward()
            loss += part.item()
        return loss
    losses = _train_reference(train_cfg, list(model.parameters()), accumulate)
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

    def accumulate(loader, step):
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
        return loss

    @torch.no_grad()
    def copy_to_compute():
        for m, p in zip(master, compute):
            p.copy_(m)
    losses = _train_reference(cfg, master, accumulate, copy_to_compute)
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
