"""Activation recomputation (Chen et al. 2016; selective recomputation, Korthikanti et al. MLSys'23).

``full``: each transformer block keeps only its input and reruns its forward during backward (activation
memory per layer 2sbh in 16-bit). ``selective``: only the attention core (QK^T, softmax, AV: the 5as/h
term of Korthikanti Table 2) is recomputed. Applied by replacing the ``forward`` of the block or core
instance with a checkpointed call, so parameter names and module structure stay those of the plain model;
any collectives inside a recomputed region run again in backward, as in Megatron-LM.
"""

from __future__ import annotations

import types

from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


def _checkpointed_forward(self: nn.Module, *args):
    return checkpoint(type(self).forward, self, *args, use_reentrant=False)


def _checkpointed(module: nn.Module) -> None:
    """The instance's forward runs its class's forward under a checkpoint; a bound method, so a deep copy of
    the module (DualPipe's second copy of a stage) recomputes its own forward, not the original's."""
    module.forward = types.MethodType(_checkpointed_forward, module)


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Recompute every block (``full``) or every attention core (``selective``) in backward."""
    if mode not in MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; choose one of {', '.join(MODES)}")
    for layer in model.layers.values():
        if mode == "full":
            _checkpointed(layer)
        elif mode == "selective":
            _checkpointed(layer.attention.core)
    return model
