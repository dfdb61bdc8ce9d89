"""Running the real code without data: torch's fake process group and fake tensors, with the small integer
tensors that decide shapes kept real.

Under ``FakeTensorMode`` (torch._subclasses; what torchtitan's memory estimation uses) a tensor is a shape,
a dtype and a device: nothing is allocated, nothing is computed. A few decisions of the runtime read values,
not shapes: a context-parallel block plan compares positions, the vocabulary-parallel loss indexes the targets
that fall in its shard, MoE routing counts tokens per expert. Those values are integers derived from integers the
rank holds (positions, token ids, counts), so :class:`RealIndexTensors` computes them for real: an operator whose
tensor inputs are all real runs for real, and a factory (``arange``) whose results are integer or boolean is made
real. Floating-point tensors (weights, activations, gradients, optimizer state) stay fake.

MoE routing depends on the router's output, which is fake: :func:`balance_routing` swaps every MoE layer's
router decision for the balanced one (token t's j-th choice is expert (t k + j) mod E), so that every rank routes
the same counts and an all-to-all of counts can be answered by the recording transport without data.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallelisms.model.moe import MoE


class RealIndexTensors(TorchDispatchMode):
    """Inside ``FakeTensorMode``: operators on real tensors only run for real; integer/boolean factories are real."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        any_tensor, any_fake = _scan(args, kwargs)
        if any_tensor and not any_fake:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not any_tensor:  # a factory: integer results (arange, zeros of indices) are decisions, so real
            made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if made and not any(t.is_floating_point() or t.is_complex() for t in made):
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
        return out


def _scan(args: tuple, kwargs: dict) -> tuple[bool, bool]:
    """Whether an operator's arguments hold a tensor, and a fake one (operator arguments nest one level: a list
    of tensors at most; this runs on every operator, so without pytree's generality)."""
    any_tensor = any_fake = False
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                any_tensor = True
                if isinstance(t, FakeTensor):
                    return True, True
    return any_tensor, any_fake


@contextmanager
def fake_rank(rank: int, world_size: int):
    """Rank ``rank`` of a ``world_size``-rank world on torch's fake process group, fake tensors on: the caller
    builds the meshes, the model and the step inside. The group is destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group (it starts the fake one)")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), RealIndexTensors():
            yield
    finally:
        dist.destroy_process_group()


class BalancedRouting(MoE):
    """An MoE layer whose router's choice is replaced by the balanced assignment (see the module docstring);
    the router still runs (its compute, its memory, the collectives of the sequence layout)."""

    def route(self, x: torch.Tensor):
        top_experts, weights, keep, aux = super().route(x)
        batch, seq, k = top_experts.shape
        balanced = torch.arange(batch * seq * k, device=top_experts.device).view(batch, seq, k) % self.n_experts
        return balanced, weights, torch.ones_like(balanced, dtype=torch.bool), aux


def balance_routing(model: torch.nn.Module) -> None:
    """Swap every MoE layer's routing for :class:`BalancedRouting` (the dry run, and the real runs it is
    compared with)."""
    for module in model.modules():
        if type(module) is MoE:
            module.__class__ = BalancedRouting
