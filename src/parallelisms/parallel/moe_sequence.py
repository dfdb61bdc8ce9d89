"""A mixture-of-experts layer on a sharded sequence, with routing exact per whole sequence: the capacity
limit keeps each sequence's assignments in token order and the load-balancing loss averages over each
sequence (DeepSeek-V3's sequence-wise auxiliary loss), so a rank holding part of a sequence needs the rest
of the sequence's routing. Two parallelisms shard the sequence around the layer, and each gets the cheapest
exact remedy for how its ranks share the loss:

- Megatron sequence parallelism (Korthikanti et al. 2023) over ``tp``: the block's input is this rank's
  [batch, seq/tp, dim] shard. The layer all-gathers it over tp (backward: this rank's slice of the gradient,
  no sum, since everything after the gather is replicated over tp and so is its gradient), routes and runs
  the experts as plain tensor parallelism does (experts whole on every tp rank, as Megatron-Core with expert
  TP 1) and keeps its slice of the output (backward: all-gather). Router and expert gradients are then the
  full ones on every tp rank, like without SP: not marked sharded over tp, never summed over it, counted once
  by the global norm. Cost per layer: one all-gather of the activation forward and one of its gradient
  backward, (tp-1)/tp x batch x seq x dim elements per rank each; the experts' work is replicated over tp.
- Context parallelism (ring attention, Liu et al. 2023; Ulysses, Jacobs et al. 2023) over ``cp``: the rank
  holds the tokens at ``positions`` (zigzag chunks for the ring). Tokens stay put; only the router logits
  travel: an all-gather over cp of [batch, seq/cp, E], put in position order, gives every rank the same
  top-k, capacity and aux loss of whole sequences, and each keeps its own tokens' rows, whose experts it runs
  (so expert parallelism dispatches them as usual). Backward reduce-scatters the logits' gradient: each owner
  receives the sum over cp ranks, which is right because every cp rank's loss holds the (same) aux term and
  the gradient sync averages over dp x cp, so the term counts once. Cost per layer: (cp-1)/cp x batch x seq
  x E elements per rank each way (E/dim of an activation gather), and the top-k of the whole sequence.

Under both, the tp gather comes first (the cp chunk), then the cp gather of its logits.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from parallelisms.comm import Comm, gather_along, split_along
from parallelisms.model.moe import MoE, WholeSequences


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedSequences(WholeSequences):
    """The layout of a MoE layer's input sharded over ``tp`` (sequence parallelism) and/or ``cp`` (this rank's
    ``positions``; ``order`` sorts the cp-gathered rows into position order)."""

    tp: Comm | None = None
    cp: Comm | None = None
    positions: torch.Tensor | None = None
    order: torch.Tensor | None = None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else gather_along(x, self.tp, dim=1, backward="split")

    def whole(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.cp is None else gather_along(logits, self.cp, dim=1)[:, self.order.to(logits.device)]

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.cp is None else t[:, self.positions.to(t.device)]

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.tp is None else split_along(y, self.tp, dim=1)


def shard_moe_sequences(model: nn.Module, **layout) -> None:
    """Add ``layout`` (``tp=``, or ``cp=, positions=, order=``) to the sequence layout of every MoE layer."""
    for layer in model.layers.values():
        moe = layer.feed_forward
        if isinstance(moe, MoE):
            current = moe.sequence if isinstance(moe.sequence, ShardedSequences) else ShardedSequences()
            moe.sequence = dataclasses.replace(current, **layout)
