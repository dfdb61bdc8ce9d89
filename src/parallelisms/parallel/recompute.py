"""Activation recomputation (Chen et al. 2016; selective recomputation, Korthikanti et al. MLSys'23).

``full``: each transformer block keeps only its input and reruns its forward during backward (activation
memory per layer 2sbh in 16-bit). ``selective``: only the attention core (QK^T, softmax, AV: the 5as/h
term of Korthikanti Table 2) is recomputed. Applied by replacing the ``forward`` of the block or core
instance with a checkpointed call, so parameter names and module structure stay those of the plain model;
any collectives inside a recomputed region run again in backward, as in Megatron-LM.

The recomputation calls the class's forward directly, past the module's forward hooks. A sharding engine that
swaps a unit's full weights in only around the module's call (:mod:`parallelisms.parallel.fsdp2`, which FSDP2
also does with hooks) registers a context with :func:`register_recompute_context`: checkpoint's ``context_fn``
enters it around the recomputation (``use_reentrant=False``), so the recomputed forward sees the same weights.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from contextlib import ExitStack, contextmanager, nullcontext

from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from parallelisms.options import Recompute

MODES = tuple(Recompute)
_CONTEXTS = "_parallelisms_recompute_contexts"


def register_recompute_context(module: nn.Module, factory) -> RemovableHandle:
    """Around every recomputation of ``module`` in backward, enter ``factory()``'s context manager;
    ``factory`` is called during the module's forward (the call that will be recomputed)."""
    contexts = module.__dict__.setdefault(_CONTEXTS, OrderedDict())  # weakly referenced by the handle
    handle = RemovableHandle(contexts)
    contexts[handle.id] = factory
    return handle


@contextmanager
def _all_of(contexts):
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _checkpointed_forward(self: nn.Module, *args):
    recompute = [factory() for factory in getattr(self, _CONTEXTS, {}).values()]
    return checkpoint(type(self).forward, self, *args, use_reentrant=False,
                      context_fn=lambda: (nullcontext(), _all_of(recompute)))


def _checkpointed(module: nn.Module) -> None:
    """The instance's forward runs its class's forward under a checkpoint; a bound method, so a deep copy of
    the module (DualPipe's second copy of a stage) recomputes its own forward, not the original's."""
    module.forward = types.MethodType(_checkpointed_forward, module)


def recompute_swap(model: nn.Module, comms, parallel, train) -> None:
    """The registry's transform (:func:`parallelisms.train_setup.parallelize`): ``--recompute``'s mode, if any."""
    if parallel.recompute is not Recompute.NONE:
        apply_recompute(model, parallel.recompute)


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Recompute every block (``full``) or every attention core (``selective``) in backward."""
    if mode not in MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; choose one of {', '.join(MODES)}")
    for layer in model.layers.values():
        if mode == Recompute.FULL:
            _checkpointed(layer)
        elif mode == Recompute.SELECTIVE:
            _checkpointed(layer.attention.core)
    return model
