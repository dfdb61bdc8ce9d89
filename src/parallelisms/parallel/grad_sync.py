"""The one interface through which a layout's gradients reach the optimizer, and its simplest implementation.

Every layout's training step is the same (``parallelisms.trainer.Trainer``): ``zero_grad`` -> forward and
backward over the microbatches (all but the last inside ``no_sync``) -> ``finish`` -> global gradient norm
-> clip -> optimizer step over ``parameters()`` -> ``after_step``. What differs between DDP, ZeRO/FSDP
(flat, per-parameter, buffer reuse) and the pipeline's data-parallel sync is only how gradients are reduced
and where the optimizer's parameters live, which is this protocol (torchtitan keeps one ``train_step`` in the
same way, whatever ``parallelize`` did).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import ContextManager, Protocol

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.parallel.common import gather_full, global_grad_norm
from parallelisms.parallel.memory import memory_report, tensor_bytes
from parallelisms.parallel.placement import Piece, tensor_pieces


class GradSync(Protocol):
    """Implemented by :class:`LocalGradients`, ``DataParallel``, ``ShardedEngine`` (ZeRO-1/2/3, FSDP1
    strategies), ``PerParamSharding`` (FSDP2), ``ReuseSharding`` (YaFSDP) and the pipeline's
    ``StageGradients`` / ``StageSharding`` (a held engine of any of the sharded kinds per stage)."""

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates (full parameters, flat shards or per-parameter shards)."""

    def zero_grad(self) -> None:
        """Drop the step's gradients."""

    def no_sync(self) -> ContextManager:
        """Accumulate locally: every microbatch but the last."""

    def finish(self) -> None:
        """Complete the step's reductions (those still in flight after backward)."""

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the whole model's gradient, identical on every rank."""

    def after_step(self) -> None:
        """After the optimizer step (the sharded engines refresh parameters from their shards)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, full over every mesh dimension but the pipeline's, by plain names; a
        collective."""

    def memory(self, optimizers) -> dict:
        """Persistent bytes of parameters, gradients and optimizer state, transient peaks, process peak."""

    def placements(self) -> list[tuple[torch.Tensor, list[Piece]]]:
        """Each optimizer parameter with the boxes of the plain model's full parameters it holds
        (:mod:`parallelisms.parallel.placement`): what a checkpoint saves and loads, in any layout."""

    def remove(self) -> None:
        """Take this sync's hooks out of the model once training is over. A hook on a tensor that has views (a
        flat parameter) closes a cycle through autograd's C++ side, which Python's collector cannot free: the
        model, the engine and its process groups (with gloo's threads) would outlive the run."""


class LocalGradients:
    """Gradients as autograd leaves them, nothing to reduce: one data-parallel replica (tensor, context or
    expert parallelism alone reduce inside their own layers). ``DataParallel`` extends it with buckets."""

    def __init__(self, module: nn.Module, comms: Comms):
        self.module, self.comms = module, comms
        self.params = [p for p in module.parameters() if p.requires_grad]

    def parameters(self) -> list[nn.Parameter]:
        return self.params

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def no_sync(self) -> ContextManager:
        return nullcontext()

    def finish(self) -> None:
        """Nothing in flight."""

    def remove(self) -> None:
        """No hook."""

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm(self.params, self.comms)

    def after_step(self) -> None:
        """Nothing to refresh: the optimizer updated the parameters themselves."""

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gathered over the dimensions a parameter is marked sharded on (tensor and expert parallelism)."""
        return {name: gather_full(p, self.comms).cpu().clone() for name, p in self.module.named_parameters()}

    def memory(self, optimizers) -> dict:
        return memory_report(tensor_bytes(self.params), tensor_bytes(p.grad for p in self.params), optimizers)

    def placements(self) -> list[tuple[torch.Tensor, list[Piece]]]:
        """Every parameter whole, placed by its tensor/expert-parallel marks."""
        return [(p, tensor_pieces(name, p, self.comms)) for name, p in self.module.named_parameters()
                if p.requires_grad]


@contextmanager
def syncing_off(owner):
    """Set ``owner.syncing`` False inside the block (the engines' ``no_sync``)."""
    previous, owner.syncing = owner.syncing, False
    try:
        yield
    finally:
        owner.syncing = previous
