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

import math
from dataclasses import dataclass

import torch
from torch import nn

from parallelisms.config import ModelConfig, TrainConfig
from parallelisms.errors import ConfigError
from parallelisms.data.sources import training_loader
from parallelisms.lr_schedule import make_scheduler
from parallelisms.model import build_model
from parallelisms.parallel.pipeline.schedules import pipeline_microbatches
from parallelisms.optim import decays

TOLERANCE = 1e-5
# bf16 training against the plain bf16 reference (one bf16 gradient of the whole batch rather than per-rank
# bf16 gradients summed in fp32): both round the same weights and activations to bf16 (unit roundoff 2^-8),
# and Adam turns the different gradient roundings into sign-level updates where a gradient is near zero.
# Measured at dp 2 after 3 steps: 1.3e-5 on losses, 6.6e-3 on the worst parameter tensor, while fp32 training
# is 2.3e-2 away, so 1e-2 still tells bf16 from fp32 (it grows with the number of partial gradients: 1.3e-2 at
# dp 4). Against the same arithmetic (reference_train_bf16(splits=dp)), which `verify` uses, runs agree to
# about 1e-8 and the 1e-5 contract holds.
BF16_TOLERANCE = 1e-2
# bf16 layouts whose arithmetic has no single-process twin (tensor parallelism's bf16 partial sums all-reduced
# in bf16; Zero Bubble's deferred weight gradients accumulated in bf16) are checked against an envelope instead:
# each step's loss and gradient norm and each parameter tensor must be no farther from single-process bf16
# training (same splits) than BF16_ENVELOPE x the spread of several legitimate computations of this very run: the
# same bf16 training with the batch's gradient taken over 1, 2, 4 and 8 slices (BF16_SAMPLE_SLICES: each slice's
# bf16 gradient summed in fp32, so four orders of bf16 rounding), the layout's own slicing, and fp32 training (no
# rounding). The spread is their largest pairwise distance (a series: per step, the worst step; a tensor: relative
# to the reference tensor), so it is never below the one pair (bf16, fp32) a one-sample envelope would use. One
# sample under-states it: on `tiny`, 3 steps, clip 0.5, default decay, dp2 x tp2 +sp ZeRO-3's step 2 gradient norm
# is 4.3e-3 from its bf16 twin, where that twin is 1.7e-3 from fp32 but the slicings alone span 3.5e-3 (ratio
# 1.21; one sample: 2.56); its worst tensor scores 0.92 (one sample: 0.95). A layout error moves a tensor by a
# share of its update, single-process bf16 by 2% of its value here, so the envelope stays one order below what a
# missing reduction does.
BF16_SAMPLE_SLICES = (1, 2, 4, 8)
BF16_ENVELOPE = 2.0
# A tensor's own distance is floored at bf16's unit roundoff (relative): the bf16 copy every layout computes with is
# that far from the fp32 master weights anyway (norm weights near 1.0 that barely moved otherwise set a limit of
# 7e-5, a tenth of one bf16 step).
BF16_UNIT_ROUNDOFF = 2.0 ** -8
# float64 (`verify --dtype float64`): unit roundoff 1.1e-16, so a correct layout lands many orders of magnitude
# below this and a logic error many orders above it.
TOLERANCE_FLOAT64 = 1e-10
# fp32 parameters that miss TOLERANCE may still be rounding: Adam divides each element's update by that element's
# own gradient scale, so where a gradient element is near zero a last-bit difference becomes an update of order
# lr. The fp32 single-process reference is then itself off exact (float64) training: on `small`, lr 3e-3, 2 steps,
# by 3.1e-5 on layers.2.attention.wo, which the cp 2 (Ulysses, ring x tp 2) layouts missed by 1.1-4.3e-5 while
# their float64 runs agree to 9e-14. Such a tensor passes when it is no farther from float64 training than
# ROUNDING_FACTOR x the fp32 reference's own distance from it (measured ratios: see docs/verify.md).
ROUNDING_FACTOR = 2.0


@dataclass(frozen=True)
class Run:
    """What a training run is compared by: per-step losses, per-step global gradient norms before clipping
    (None where a layout has no single norm, as PipeDream's per-stage updates), and the final parameters."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    grad_norms: list[float] | None = None

    @classmethod
    def of(cls, run: "Run | dict") -> "Run":
        """A :class:`Run` from itself or from a train report (``losses``, ``state``, ``grad_norms``)."""
        return run if isinstance(run, Run) else cls(run["losses"], run["state"], run.get("grad_norms"))

    def first_nonfinite(self) -> str | None:
        """Where the run first holds a NaN or Inf: ``step 3 loss nan``, ``step 2 gradient norm inf`` or
        ``parameter layers.0.attention.wq.weight``; None when everything is finite."""
        norms = self.grad_norms or [0.0] * len(self.losses)
        for step, (loss, norm) in enumerate(zip(self.losses, norms)):
            if not math.isfinite(norm):
                return f"step {step} gradient norm {norm}"
            if not math.isfinite(loss):
                return f"step {step} loss {loss}"
        for name, tensor in self.state.items():
            if not torch.isfinite(tensor).all():
                return f"parameter {name}"
        return None


class ReferenceDiverged(ConfigError):
    """The single-process reference itself is not finite at these settings: nothing can be verified."""


def check_reference(reference: Run, cfg: TrainConfig) -> Run:
    """Raise :class:`ReferenceDiverged` (one line, before any process starts) when ``reference`` diverged."""
    where = reference.first_nonfinite()
    if where is not None:
        raise ReferenceDiverged(
            f"single-process training itself diverges at these settings ({where}; --lr {cfg.lr:g}, --grad-clip "
            f"{cfg.grad_clip:g}), so there is nothing to verify against; lower --lr (default 3e-3)"
            + ("" if cfg.grad_clip else " or clip (--grad-clip 1)"))
    return reference


@torch.no_grad()
def clip_grad_norm_float64(params, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm accumulated in float64; ``max_norm`` 0 only measures.

    torch's fp32 ``vector_norm`` on the CPU loses accuracy on large tensors: on an 8192 x 64 output-layer
    gradient it was 4e-4 relative below the float64 value, enough to move the clip factor and, through
    Adam, parameters by 2e-5. The parallel runs sum fp32 squares with ``torch.sum`` (pairwise, within 1e-7
    of float64), so the reference must be at least as accurate for the comparison to test the layout.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm


def _plain_model(model_cfg: ModelConfig, cfg: TrainConfig) -> nn.Module:
    """The seeded plain model (with ``tie_embeddings`` one parameter for the embedding and the head, as
    ``transformers`` ties them)."""
    torch.manual_seed(cfg.seed)
    return build_model(model_cfg, cfg.seed, dtype=cfg.torch_dtype)


def _full_state(model_cfg: ModelConfig, state: dict) -> dict:
    """``state`` by every name a layout reports: a tied head under its own name too."""
    return {**state, "output.weight": state["tok_embeddings.weight"]} if model_cfg.tie_embeddings else state


def _train_reference(cfg: TrainConfig, named: list, accumulate, after_step=lambda: None):
    """The loop both references share: ``accumulate(loader, step)`` leaves the step's gradient in each of the
    ``named`` parameters' ``.grad`` and returns the loss; then the global norm (clipping when asked), AdamW over
    them in two groups (weight decay on the matrices only, unless ``decay_all``: ``parallelisms.optim.decays``)
    and the learning-rate schedule. Returns the per-step losses and gradient norms."""
    params = [p for _, p in named]
    chosen = [decays(name, p.dim(), cfg) for name, p in named]
    groups = [{"params": [p for p, d in zip(params, chosen) if d]},
              {"params": [p for p, d in zip(params, chosen) if not d], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas,
                                  weight_decay=cfg.weight_decay, eps=cfg.eps)
    scheduler = make_scheduler(optimizer, cfg)
    loader = training_loader(cfg)
    losses, norms = [], []
    for step in range(cfg.steps):
        losses.append(accumulate(loader, step))
        norms.append(clip_grad_norm_float64(params, cfg.grad_clip).item())
        optimizer.step()
        scheduler.step()
        after_step()
    return losses, norms


def reference_train(model_cfg: ModelConfig, train_cfg: TrainConfig, splits: int = 1) -> Run:
    """Single-process training in ``train_cfg.dtype``: per-step losses and gradient norms, final parameters.

    ``splits`` > 1 accumulates the gradient over that many equal slices of the global batch (plain gradient
    accumulation), the summation order of a layout that divides the batch over ranks and microbatches.
    ``verify`` uses it so that what remains is the parallel arithmetic alone: with Adam, the order in which
    per-sample gradients are summed already moves a tensor by up to ~1.5e-5 (``small`` preset, lr 3e-3, 4
    slices against 1), which is rounding, not a layout's error, and scales with lr.
    """
    model = _plain_model(model_cfg, train_cfg)

    def accumulate(loader, step):
        model.zero_grad(set_to_none=True)
        loss = 0.0
        for piece in range(splits):
            part = model(*loader.shard(step, piece, splits)) / splits
            part.backward()
            loss += part.item()
        return loss
    losses, norms = _train_reference(train_cfg, list(model.named_parameters()), accumulate)
    return Run(losses, _full_state(model_cfg, {name: p.detach().clone() for name, p in model.named_parameters()}),
               norms)


def reference_train_bf16(model_cfg: ModelConfig, cfg: TrainConfig, splits: int = 1) -> Run:
    """Single-process mixed precision: bf16 weights and compute, fp32 master weights, gradients and AdamW.

    ``splits`` > 1 takes the bf16 gradient of each data-parallel rank's rows separately and sums them in
    fp32 divided by ``splits``: the arithmetic of an N-rank run, done in one process."""
    model = _plain_model(model_cfg, cfg.replace(dtype="float32"))
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
    losses, norms = _train_reference(cfg, list(zip(names, master)), accumulate, copy_to_compute)
    return Run(losses, _full_state(model_cfg, {n: m.detach().clone() for n, m in zip(names, master)}), norms)


def batch_slices(parallel, train: TrainConfig) -> int:
    """Equal slices of the global batch whose mean losses a layout averages: data-parallel ranks x pipeline
    microbatches, or x gradient-accumulation microbatches (context and tensor parallelism split tokens and
    weights, not rows). The references accumulate over as many, so what remains is the parallel arithmetic."""
    if parallel.dims.pp > 1:
        return parallel.dims.dp * pipeline_microbatches(parallel)
    return parallel.dims.dp * train.grad_accum


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _worst(diffs) -> float:
    """The largest of ``diffs``, NaN if any is NaN (``max`` lets a NaN fall through)."""
    return max(diffs, key=lambda d: (math.isnan(d), d))


def _tensor_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.to(ref.dtype)
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def compare(run: Run | dict, reference: Run, tolerance: float = TOLERANCE, exact: Run | None = None) -> dict:
    """Maximum relative differences of losses, gradient norms (before clipping) and parameters, and whether
    all are within ``tolerance``. A NaN or Inf anywhere in ``run`` fails, naming where it first appeared
    (``nonfinite``); NaN differences never pass (every check is ``diff <= tolerance``).

    ``exact``, the same training in float64, settles fp32 parameters that miss ``tolerance``: such a tensor
    still passes when it is no farther from ``exact`` than ``ROUNDING_FACTOR`` times the fp32 reference's
    own distance from ``exact`` (what fp32 rounding does to single-process training at these settings);
    those tensors are listed in ``rounding_explained``."""
    run = Run.of(run)
    if set(run.state) != set(reference.state):
        raise ValueError(f"parameter names differ: {sorted(set(run.state) ^ set(reference.state))[:5]}")
    loss_diff = _worst(_rel(a, b) for a, b in zip(run.losses, reference.losses))
    norm_diff = None
    if run.grad_norms is not None and reference.grad_norms is not None:
        norm_diff = _worst(_rel(a, b) for a, b in zip(run.grad_norms, reference.grad_norms))
    worst_name, param_diff, abs_diff, params_ok, explained = "", -math.inf, 0.0, True, {}
    for name, ref in reference.state.items():
        got = run.state[name]
        if got.shape != ref.shape:
            raise ValueError(f"parameter {name} has shape {tuple(got.shape)}, reference {tuple(ref.shape)}")
        diff = _tensor_rel(got, ref)
        abs_diff = _worst([abs_diff, (got.to(ref.dtype) - ref).abs().max().item()])
        if not diff <= param_diff and not math.isnan(param_diff):  # a NaN stays the worst
            worst_name, param_diff = name, diff
        if diff <= tolerance:
            continue
        if exact is None or math.isnan(diff):
            params_ok = False
            continue
        from_exact, envelope = _tensor_rel(got, exact.state[name]), _tensor_rel(ref, exact.state[name])
        explained[name] = {"vs_reference": diff, "vs_float64": from_exact, "reference_vs_float64": envelope}
        params_ok &= from_exact <= ROUNDING_FACTOR * envelope
    nonfinite = run.first_nonfinite() or (reference.first_nonfinite() and f"reference: {reference.first_nonfinite()}")
    ok = (nonfinite is None and params_ok and loss_diff <= tolerance
          and (norm_diff is None or norm_diff <= tolerance))
    result = {"max_loss_rel_diff": loss_diff, "max_grad_norm_rel_diff": norm_diff,
              "max_param_rel_diff": param_diff, "worst_param": worst_name, "max_param_abs_diff": abs_diff,
              "nonfinite": nonfinite, "tolerance": tolerance, "ok": ok}
    if explained:
        result["rounding_explained"] = explained
    return result


def compare_settled(run: Run | dict, reference: Run, exact_of, tolerance: float = TOLERANCE) -> dict:
    """:func:`compare`; where an fp32 run's parameters miss ``tolerance`` (and nothing is non-finite), again
    with ``exact_of()``, the same single-process training in float64, to settle whether that is rounding
    (:data:`ROUNDING_FACTOR`). How far Adam amplifies rounding depends on the CPU's kernels: tp 4 with SP on
    `tiny` ends 1.03e-5 from the fp32 reference on one machine and within 1e-5 on another."""
    result = compare(run, reference, tolerance)
    if result["ok"] or result["nonfinite"] or next(iter(reference.state.values())).dtype != torch.float32:
        return result
    return compare(run, reference, tolerance, exact=exact_of())


def bf16_samples(model_cfg: ModelConfig, cfg: TrainConfig, splits: int) -> list[Run]:
    """The envelope's other computations of a bf16 run (see BF16_ENVELOPE): single-process bf16 training over
    each of ``BF16_SAMPLE_SLICES`` slices that divides the batch (not ``splits``, the twin itself), and fp32
    training."""
    slices = [k for k in BF16_SAMPLE_SLICES if k != splits and cfg.global_batch % k == 0]
    return [reference_train(model_cfg, cfg.replace(dtype="float32"))] + [
        reference_train_bf16(model_cfg, cfg, splits=k) for k in slices]


def _spread(values: list) -> float:
    """The largest distance between two of ``values``."""
    return max(values) - min(values)


def _tensor_spread(tensors: list[torch.Tensor], ref: torch.Tensor) -> float:
    """The largest distance between two of ``tensors``, relative to ``ref``."""
    scale = ref.norm().clamp_min(1e-30)
    return max(((a.to(ref.dtype) - b.to(ref.dtype)).norm() / scale).item()
               for i, a in enumerate(tensors) for b in tensors[i + 1:])


def compare_mixed_precision(run: Run | dict, bf16: Run, samples, tolerance: float = TOLERANCE) -> dict:
    """A bf16 layout against single-process bf16 training (``bf16``, same splits): within ``tolerance`` (the
    same arithmetic), or else within the envelope: every step's loss and gradient norm and every parameter
    tensor no farther from ``bf16`` than ``BF16_ENVELOPE`` x the spread of ``bf16`` and ``samples`` (a list of
    runs, or a function returning it, called only when needed: :func:`bf16_samples`, or fp32 training alone),
    a tensor's at least ``BF16_UNIT_ROUNDOFF``. The result is :func:`compare`'s against ``bf16``, with
    ``envelope``: the worst such ratio, and ``envelope_samples``: how many runs the spread is over."""
    run = Run.of(run)
    result = compare(run, bf16, tolerance)
    if result["ok"] or result["nonfinite"]:
        return result
    runs = [bf16] + list(samples() if callable(samples) else samples)
    ratios = [_tensor_rel(run.state[n], ref) / max(_tensor_spread([r.state[n] for r in runs], ref), BF16_UNIT_ROUNDOFF)
              for n, ref in bf16.state.items()]
    series = [(run.losses, [r.losses for r in runs])]
    if run.grad_norms is not None and all(r.grad_norms is not None for r in runs):
        series.append((run.grad_norms, [r.grad_norms for r in runs]))
    for got, refs in series:
        ratios.append(max(abs(a - b) for a, b in zip(got, refs[0])) /
                      max(max(_spread(list(step)) for step in zip(*refs)), 1e-30))
    worst = _worst(ratios)
    return {**result, "envelope": worst, "envelope_limit": BF16_ENVELOPE, "envelope_samples": len(runs),
            "ok": worst <= BF16_ENVELOPE}
