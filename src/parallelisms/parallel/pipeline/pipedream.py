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
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from parallelisms.comm import CommLedger, Comms, Timeline
from parallelisms.config import ModelConfig, TrainConfig
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.data.loader import microbatches
from parallelisms.model import build_model
from parallelisms.parallel.pipeline.partition import equal_bounds
from parallelisms.parallel.pipeline.schedules import Action
from parallelisms.parallel.pipeline.stage import stage_of_parameter
from parallelisms.optim import make_optimizer
from parallelisms.parallel.common import clip_grad_norm_


class WeightStashing:
    """PipeDream's per-stage updates inside the schedule, with weight stashing: the executor's forward
    (:meth:`forward`) runs a stage on the stashed version its microbatch must see, and its OPTIMIZER action
    (:meth:`update`) clips by the stage's own norm (summed over tp) and steps the stage's own optimizer. Call
    :meth:`start_window` before each step's schedule (the window ends in a drain)."""

    def __init__(self, stages: dict[int, torch.nn.Module], cfg: TrainConfig, comms: Comms):
        self.cfg, self.comms = cfg, comms
        self.named = {s: dict(st.named_parameters()) for s, st in stages.items()}
        self.optimizers = {s: make_optimizer(list(named.values()), cfg) for s, named in self.named.items()}
        self.start_window()

    def start_window(self) -> None:
        self.stash: dict[int, tuple[int, dict]] = {}   # stage -> (version, stashed weights)
        self.leaves: dict[tuple[int, int], dict] = {}  # (stage, mb) -> the leaves its forward used
        self.updates = {s: 0 for s in self.named}      # updates applied in this window

    def forward(self, a: Action, module, x, targets, **kwargs):
        if a.version != self.updates[a.stage]:
            raise RuntimeError(f"stage {a.stage} forward of mb {a.mb} expects version {a.version}, "
                               f"but {self.updates[a.stage]} updates were applied")
        version, weights = self.stash.get(a.stage, (None, None))
        if version != a.version:  # the first forward of this version stashes it
            weights = {n: p.detach().clone() for n, p in self.named[a.stage].items()}
            self.stash[a.stage] = (a.version, weights)
        leaves = {n: w.detach().requires_grad_() for n, w in weights.items()}
        self.leaves[(a.stage, a.mb)] = leaves
        return functional_call(module, leaves, (x, targets), kwargs)

    def update(self, a: Action) -> None:
        leaves = self.leaves.pop((a.stage, a.mb))
        params = list(self.named[a.stage].values())
        for name, p in self.named[a.stage].items():
            p.grad = leaves[name].grad
        if self.cfg.grad_clip > 0:  # the stage's own norm: communication within its tp group only
            clip_grad_norm_(params, self.cfg.grad_clip, self.comms, within=("tp",))
        self.optimizers[a.stage].step()
        for p in params:
            p.grad = None
        self.updates[a.stage] += 1


def pipedream_reference(model_cfg: ModelConfig, train_cfg: TrainConfig, pp: int, m: int
                        ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process PipeDream: per-step mean losses and final parameters (see the module docstring)."""
    torch.manual_seed(train_cfg.seed)
    model = build_model(model_cfg, train_cfg.seed, dtype=train_cfg.torch_dtype)
    bounds = equal_bounds(model_cfg.n_layers, pp)
    groups: dict[int, dict[str, torch.nn.Parameter]] = {s: {} for s in range(pp)}
    for name, p in model.named_parameters():
        groups[stage_of_parameter(name, bounds)][name] = p
    optimizers = {s: make_optimizer(list(g.values()), train_cfg) for s, g in groups.items()}
    one_rank = Comms({}, CommLedger(), Timeline(0))
    history = {s: [{n: p.detach().clone() for n, p in g.items()}] for s, g in groups.items()}  # by version
    loader = BatchLoader(load_corpus(), train_cfg.global_batch, train_cfg.seq_len, train_cfg.seed)
    losses = []
    for step in range(train_cfg.steps):
        window = []
        for k, (x, y) in enumerate(microbatches(*loader.batch(step), m)):
            leaves = {n: w.detach().requires_grad_() for s in range(pp)
                      for n, w in history[s][step * m + max(0, k - (pp - 1 - s))].items()}
            loss = functional_call(model, leaves, (x, y))
            loss.backward()
            window.append(loss.detach())
            for s, g in groups.items():
                for n, p in g.items():
                    p.grad = leaves[n].grad
                if train_cfg.grad_clip > 0:  # the stage clip's own arithmetic, on one rank: bit for bit
                    clip_grad_norm_(list(g.values()), train_cfg.grad_clip, one_rank)
                optimizers[s].step()
                history[s].append({n: p.detach().clone() for n, p in g.items()})
        losses.append((torch.stack(window).sum() / m).item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
