"""PipeDream (Narayanan et al., SOSP 2019): asynchronous 1F1B, one weight update per microbatch, with
weight stashing; and the single-process reference that reproduces its delayed updates exactly.

Semantics made exact. Every stage keeps its own optimizer and steps it right after each microbatch's
backward (the schedule's OPTIMIZER action) with that microbatch's gradient (the gradient of its mean
loss; global-norm clipping is per stage, since stages update at different times; under tensor
parallelism the stage's norm sums its sharded weights' squares over the stage's tp group, whose ranks run
the same schedule, and counts replicated ones once). The forward of a
microbatch uses the stage's current weights (version v = updates applied so far) and its backward must
use the same weights, although the stage has been updated since: the forward runs on a stashed copy of
version v (``torch.func.functional_call`` with fresh leaves over the stash), whose gradients feed the
update. In 1F1B order stage s of p runs p-1-s forwards ahead of its first backward, so microbatch k's
forward there sees version max(0, k - (p-1-s)) of the window (the window ends in a drain, so windows
start at version ``step x m``): :func:`pipedream_reference` trains the plain model with exactly those
versions, without any schedule.

Data parallelism within a stage, as in the paper's replicated stages: the replicas of a stage (ranks that
hold other rows, or with context parallelism other tokens, of the same microbatch) run the same schedule, and
the stage's own data-parallel engine (the layout's DDP, as for any schedule: :mod:`.stage_sync`) averages each
update's gradient: the executor launches its reduction after the microbatch's backward, the update waits for it
(expert weights over the ranks holding the same experts, divided like the rest). Microbatch k of the step is
then every replica's k-th microbatch together, which is what the reference trains on.

Mixed precision (bf16): the stage's parameters are the fp32 master weights; each stashed version is their
bf16 cast, the forward and backward run on it, and its gradient is upcast into the parameter's before averaging
and the update (so the stage's engine is DDP over the fp32 weights, not the flat engine's bf16 NO_SHARD plan).

Full recomputation: a block recomputed in backward runs after its forward call has returned, when the
stage's live (updated) weights are back in place; each block therefore registers a recompute context that
swaps in the weights its forward saw (:func:`parallelisms.parallel.recompute.register_recompute_context`).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch.func import functional_call

from parallelisms.comm import CommLedger, Comms, Timeline
from parallelisms.config import ModelConfig, TrainConfig
from parallelisms.data.sources import training_loader
from parallelisms.lr_schedule import make_scheduler
from parallelisms.data.loader import microbatches
from parallelisms.model import build_model
from parallelisms.model.numerics import upcast
from parallelisms.parallel.pipeline.partition import equal_bounds
from parallelisms.parallel.pipeline.schedules import Action
from parallelisms.parallel.pipeline.stage import stage_of_parameter
from parallelisms.optim import make_optimizer
from parallelisms.parallel.recompute import register_recompute_context
from parallelisms.parallel.common import clip_grad_norm_


class WeightStashing:
    """PipeDream's per-stage updates inside the schedule, with weight stashing: the executor's forward
    (:meth:`forward`) runs a stage on the stashed version its microbatch must see (whose gradients go to the
    stage's parameters), and its OPTIMIZER action (:meth:`update`) has the pipeline's gradient sync (``sync``: a
    ``StageSyncs``, one engine per stage held through the step, possibly wrapped) finish the stage's gradient
    (average it; under ``--ep-balance measured`` also sum each expert's copies), clips by the stage's own norm
    (summed over tp and ep, each expert once) and steps the stage's own optimizer. Call :meth:`start_window`
    before each step's schedule (the window ends in a drain, so nothing stashed outlives a step)."""

    def __init__(self, stages: dict[int, torch.nn.Module], sync, cfg: TrainConfig, comms: Comms,
                 compute_dtype: torch.dtype | None = None):
        self.cfg, self.comms, self.compute_dtype, self.sync = cfg, comms, compute_dtype, sync
        self.named = {s: dict(st.named_parameters()) for s, st in stages.items()}
        self.optimizers = {s: make_optimizer(named.items(), cfg) for s, named in self.named.items()}
        for stage in stages.values():
            for block in getattr(stage, "layers", {}).values():
                register_recompute_context(block, lambda block=block: _swapped_in(block, dict(block.named_parameters())))
        self.start_window()

    def start_window(self) -> None:
        self.stash: dict[int, tuple[int, dict]] = {}   # stage -> (version, stashed weights)
        self.updates = {s: 0 for s in self.named}      # updates applied in this window

    def forward(self, a: Action, module, x, targets, **kwargs):
        if a.version != self.updates[a.stage]:
            raise RuntimeError(f"stage {a.stage} forward of mb {a.mb} expects version {a.version}, "
                               f"but {self.updates[a.stage]} updates were applied")
        version, weights = self.stash.get(a.stage, (None, None))
        if version != a.version:  # the first forward of this version stashes it
            weights = {n: p.detach().to(self.compute_dtype or p.dtype, copy=True) for n, p in self.named[a.stage].items()}
            self.stash[a.stage] = (a.version, weights)
        leaves = {n: w.detach().requires_grad_() for n, w in weights.items()}
        for name, leaf in leaves.items():  # the gradient of the stashed version is the parameter's
            leaf.register_post_accumulate_grad_hook(functools.partial(_into_param, self.named[a.stage][name]))
        return functional_call(module, leaves, (x, targets), kwargs)

    def update(self, a: Action) -> None:
        params = list(self.named[a.stage].values())
        self.sync.finish_stage(a.stage)  # the average the executor launched after this microbatch's backward
        if self.cfg.grad_clip > 0:  # the stage's own norm: its replicas agree, so over tp (and ep) only
            clip_grad_norm_(params, self.cfg.grad_clip, self.comms, norm=self.sync.stage_grad_norm(a.stage, params))
        self.optimizers[a.stage].step()
        self.sync.engines[a.stage].zero_grad()
        self.updates[a.stage] += 1


@torch.no_grad()
def _into_param(param: torch.nn.Parameter, leaf: torch.Tensor) -> None:
    """A stashed leaf's gradient into its parameter's (upcast: mixed precision's fp32 weights take it)."""
    if param.grad is None:
        param.grad = leaf.grad.to(param.dtype)
    else:
        param.grad.copy_(leaf.grad)
    leaf.grad = None


@contextmanager
def _swapped_in(module: torch.nn.Module, weights: dict[str, torch.Tensor]):
    """``module``'s parameters replaced by ``weights`` (by name, as ``functional_call`` does) while entered."""
    owners = {name: name.rpartition(".") for name in weights}
    saved = {name: module.get_submodule(owner)._parameters[leaf] for name, (owner, _, leaf) in owners.items()}
    try:
        for name, (owner, _, leaf) in owners.items():
            module.get_submodule(owner)._parameters[leaf] = weights[name]
        yield
    finally:
        for name, (owner, _, leaf) in owners.items():
            module.get_submodule(owner)._parameters[leaf] = saved[name]


def pipedream_reference(model_cfg: ModelConfig, train_cfg: TrainConfig, pp: int, m: int, dp: int = 1,
                        compute_dtype: torch.dtype | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process PipeDream: per-step mean losses and final parameters (see the module docstring). With
    ``dp`` replicas, each update averages the gradients of every replica's k-th microbatch, taken one replica
    at a time as the ranks do; ``compute_dtype`` (bf16) runs forward and backward on a cast of the fp32
    weights, whose gradients are upcast for the update."""
    torch.manual_seed(train_cfg.seed)
    model = build_model(model_cfg, train_cfg.seed, dtype=train_cfg.torch_dtype)
    bounds = equal_bounds(model_cfg.n_layers, pp)
    groups: dict[int, dict[str, torch.nn.Parameter]] = {s: {} for s in range(pp)}
    for name, p in model.named_parameters():
        groups[stage_of_parameter(name, bounds)][name] = p
    optimizers = {s: make_optimizer(g.items(), train_cfg) for s, g in groups.items()}
    one_rank = Comms({}, CommLedger(), Timeline(0))
    history = {s: [{n: p.detach().clone() for n, p in g.items()}] for s, g in groups.items()}  # by version
    schedulers = [make_scheduler(o, train_cfg) for o in optimizers.values()]  # stepped once per step, as the Trainer
    loader = training_loader(train_cfg)
    losses = []
    for step in range(train_cfg.steps):
        window = []
        replicas = [microbatches(*loader.shard(step, d, dp), m) for d in range(dp)]
        for k in range(m):
            versions = {n: w for s in range(pp) for n, w in history[s][step * m + max(0, k - (pp - 1 - s))].items()}
            grads, loss = {}, 0.0
            for x, y in (replica[k] for replica in replicas):
                leaves = {n: w.detach().to(compute_dtype or w.dtype).requires_grad_() for n, w in versions.items()}
                part = functional_call(model, leaves, (x, y))
                part.backward()
                loss = loss + upcast(part.detach()) / dp
                for n, leaf in leaves.items():
                    g = leaf.grad.to(versions[n].dtype) / dp
                    grads[n] = g if n not in grads else grads[n] + g
            window.append(loss)
            for s, g in groups.items():
                for n, p in g.items():
                    p.grad = grads[n]
                if train_cfg.grad_clip > 0:  # the stage clip's own arithmetic, on one rank: bit for bit
                    clip_grad_norm_(list(g.values()), train_cfg.grad_clip, one_rank)
                optimizers[s].step()
                history[s].append({n: p.detach().clone() for n, p in g.items()})
        losses.append((torch.stack(window).sum() / m).item())
        for scheduler in schedulers:
            scheduler.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
