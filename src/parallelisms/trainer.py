"""One training step for every layout: zero grad -> forward/backward (the microbatch loop, or the pipeline
executor running the schedule) -> finish the gradient sync -> global gradient norm -> clip -> optimizer step ->
after-step. What differs between layouts is the gradient sync (a
:class:`parallelisms.parallel.grad_sync.GradSync`) and the forward/backward strategy, both chosen by
:func:`parallelisms.train_setup.parallelize`.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from parallelisms.comm import Comms, Timeline
from parallelisms.config import TrainConfig
from parallelisms.data.loader import microbatches
from parallelisms.model.numerics import upcast
from parallelisms.lr_schedule import make_scheduler
from parallelisms.parallel.common import clip_grad_norm_
from parallelisms.parallel.ep_balance import ExpertBalance
from parallelisms.parallel.grad_sync import GradSync
from parallelisms.options import NonFinite


class MicrobatchLoop:
    """Forward and backward of a step without a pipeline: ``grad_accum`` microbatches of this rank's rows,
    each loss divided by their count, all but the last inside the gradient sync's ``no_sync``. Context
    parallelism: each rank feeds the sequence ``positions`` it holds. Returns the local mean loss."""

    def __init__(self, model: nn.Module, comms: Comms, grad_accum: int, positions: torch.Tensor | None = None):
        self.model, self.comms, self.grad_accum, self.positions = model, comms, grad_accum, positions
        self.weight = 1.0    # the factor on this rank's loss (--dp-balance measured: its share of the batch)
        self.compute_ns = 0  # the last call's forward and backward time, waits left out (--dp-balance measured)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, grad_sync: GradSync) -> torch.Tensor:
        ledger, timeline = self.comms.ledger, self.comms.timeline
        micro = microbatches(inputs, targets, self.grad_accum)
        total, start, waited = None, Timeline.now(), ledger.waited_ns
        scale = self.weight / len(micro)
        for i, (x, y) in enumerate(micro):
            with (grad_sync.no_sync() if i < len(micro) - 1 else nullcontext()):
                with ledger.in_phase("forward"), timeline.span("forward"):
                    if self.positions is None:
                        loss = self.model(x, y) * scale
                    else:
                        pos = self.positions.to(x.device)
                        loss = self.model(x[:, pos], y[:, pos], positions=pos) * scale
                with ledger.in_phase("backward"), timeline.span("backward"):
                    loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        self.compute_ns = Timeline.now() - start - (ledger.waited_ns - waited)
        return upcast(total).cpu()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The local mean loss of this rank's rows, forward only (sharded engines gather and free as usual)."""
        total = None
        for x, y in microbatches(inputs, targets, self.grad_accum):
            if self.positions is None:
                loss = self.model(x, y)
            else:
                pos = self.positions.to(x.device)
                loss = self.model(x[:, pos], y[:, pos], positions=pos)
            total = upcast(loss) if total is None else total + upcast(loss)
        return (total / self.grad_accum).cpu()

    def report(self) -> dict:
        return {}


class Trainer:
    """One training step for every layout (see the module docstring). ``optimizer`` None: the schedule
    updates the weights itself (PipeDream's per-microbatch updates), so the step has no clip or step of its
    own and no single gradient norm."""

    def __init__(self, grad_sync: GradSync, forward_backward, comms: Comms, cfg: TrainConfig,
                 optimizer: torch.optim.Optimizer | None, stage_optimizers=()):
        self.grad_sync, self.forward_backward, self.comms, self.cfg = grad_sync, forward_backward, comms, cfg
        self.optimizer = optimizer
        self.optimizers = [optimizer] if optimizer is not None else list(stage_optimizers)  # for the memory report
        self.schedulers = [make_scheduler(o, cfg) for o in self.optimizers]  # one learning rate step per step
        self.grad_norm: torch.Tensor | None = None  # the last step's global gradient norm, before clipping
        self.skipped = False  # the last step's update was left out: its gradient norm was not finite
        self.lr = cfg.lr  # the learning rate of the last step
        self.ep_balance: ExpertBalance | None = None  # --ep-balance measured: the placement (set by parallelize)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.grad_sync.zero_grad()
        loss = self.forward_backward(inputs, targets, self.grad_sync)
        with self.comms.ledger.in_phase("backward"):
            self.grad_sync.finish()
        if self.optimizer is not None:
            self.optimizer_step()
        self.lr = self.optimizers[0].param_groups[0]["lr"]
        for scheduler in self.schedulers:
            scheduler.step()
        return loss

    def close(self) -> None:
        """After the run, on every rank: the gradient sync's hooks out of the model, the process groups and
        transports released (:meth:`parallelisms.comm.Comms.close`)."""
        self.grad_sync.remove()
        self.comms.close()

    def evaluate(self, batches) -> torch.Tensor:
        """The mean loss over ``batches`` (this rank's rows of each), averaged over every rank that holds
        other tokens (dp x cp); no gradient, no update. Its collectives are ledger phase ``eval``."""
        with self.comms.ledger.in_phase("eval"):
            local = torch.stack([self.forward_backward.evaluate(x, y) for x, y in batches]).mean()
            return self.comms["dp_cp"].all_reduce(local.reshape(1)) / self.comms["dp_cp"].size

    def optimizer_step(self) -> None:
        """Measure the global gradient norm (reported every step, clipping or not), clip by it when asked,
        step the optimizer, then the gradient sync's after-step (sharded engines refresh parameters)."""
        with self.comms.ledger.in_phase("optimizer"), self.comms.timeline.span("optimizer"):
            self.grad_norm = self.grad_sync.grad_norm()
            # the same on every rank: under --skip-nonfinite or stop-on-non-finite, no rank applies the update
            self.skipped = self.cfg.nonfinite is not NonFinite.CONTINUE and not bool(torch.isfinite(self.grad_norm))
            if self.skipped:
                return
            if self.cfg.grad_clip > 0:
                clip_grad_norm_(self.grad_sync.parameters(), self.cfg.grad_clip, self.comms, norm=self.grad_norm)
            self.optimizer.step()
            self.grad_sync.after_step()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) parameters by the plain model's names; every rank must call it. The gradient
        sync gathers this rank's stages over every dimension but the pipeline's; stages are then joined."""
        with self.comms.ledger.in_phase("report"):
            state = self.grad_sync.full_state_dict()
            if self.comms["pp"].size > 1:
                state = {name: t for part in self.comms["pp"].all_gather_object(state) for name, t in part.items()}
        return state

    def memory_report(self) -> dict:
        """Persistent bytes of parameters, gradients and optimizer state on this rank, and peaks."""
        return self.grad_sync.memory(self.optimizers)

    def report(self) -> dict:
        """Layout-specific figures merged into rank 0's report (the pipeline bubble); every rank calls it."""
        return self.forward_backward.report()
