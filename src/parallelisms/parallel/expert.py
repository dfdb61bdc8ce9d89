"""Expert parallelism: each rank of the ``ep`` group owns n_experts / ep experts of every MoE layer
(GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021; DeepSpeed-MoE).

Routing stays local (the router is replicated). The tokens a rank routed, already sorted by expert,
are sent to the experts' owners with one uneven all-to-all (the dispatch), preceded by a small
all-to-all of per-expert counts so that every rank knows what it will receive. The owner regroups the
rows by its local experts, runs them as one grouped GEMM, restores the arrival order and sends the
outputs back with the reverse all-to-all (the combine); the router's weights are applied at home.
Backward runs the same two all-to-alls in reverse (comm.all_to_all is autograd-aware). Expert weights
and their gradients stay with their owners: they are marked sharded over ``ep``, their gradients are
averaged only over the ranks holding the same experts (``ep_replicate``), global-norm clipping sums
their squares over ``ep``, and ``gather_full`` reassembles them for checkpoints and verification.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comm, all_to_all
from parallelisms.model.moe import GroupedExperts, MoE, grouped_swiglu
from parallelisms.parallel.common import mark_sharded


class ExpertParallelExperts(nn.Module):
    """This rank's slice of a layer's experts, fed by all-to-all dispatch and drained by all-to-all combine."""

    def __init__(self, full: GroupedExperts, comm: Comm, backward_comm: Comm | None = None):
        super().__init__()
        self.comm, self.backward_comm = comm, backward_comm
        self.between = None  # work to run while the dispatch is in flight (set by DualPipe's F&B chunks)
        n_experts = full.w_gate.shape[0]
        self.local = n_experts // comm.size
        first = comm.rank * self.local
        for name in ("w_gate", "w_up", "w_down"):
            shard = nn.Parameter(getattr(full, name).detach()[first:first + self.local].clone())
            setattr(self, name, mark_sharded(shard, comm.name, 0, n_experts))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: this rank's routed rows sorted by global expert, ``counts[e]`` rows for expert e."""
        n, local = self.comm.size, self.local
        send_counts = counts.view(n, local)                          # rows for each owner, by its local expert
        recv_counts = self.comm.all_to_all(send_counts.contiguous()).view(n, local)  # what each source sends me
        input_splits = send_counts.sum(1).tolist()
        output_splits = recv_counts.sum(1).tolist()
        received = all_to_all(x, self.comm, output_splits, input_splits, self.between, self.backward_comm)  # dispatch
        # arrival order is (source rank, local expert): regroup by local expert for the grouped GEMM
        expert_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(n), recv_counts.flatten())
        order = torch.argsort(expert_of, stable=True)
        out = grouped_swiglu(received[order], recv_counts.sum(0), self.w_gate, self.w_up, self.w_down)
        restored = unsort(out, order)                                                 # back to arrival order
        return all_to_all(restored, self.comm, input_splits, output_splits, backward_comm=self.backward_comm)  # combine


def unsort(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``rows`` put back in the order ``order`` took them from (``rows[i]`` came from row ``order[i]``): a gather
    by the inverse permutation, whose backward keeps only the index (``index_copy``'s keeps its source whole, for
    its shape: one more row-wide tensor per MoE layer and microbatch held for backward)."""
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    return rows[inverse]


def apply_expert_parallel(model: nn.Module, comm: Comm, backward: Comm | None = None,
                          make=ExpertParallelExperts) -> None:
    """Give every MoE layer's experts to their owners over ``comm`` (the ``ep`` mesh dimension); the backward
    all-to-alls run over ``backward``'s group (the same ranks; recorded as ``ep``) when given. ``make`` builds
    each layer's module (``--ep-balance measured``: placed experts, :mod:`parallelisms.parallel.ep_balance`)."""
    backward = type(comm)(comm.name, backward.group, comm.ledger, comm.timeline) if backward is not None else None
    for layer in model.layers.values():
        if isinstance(layer.feed_forward, MoE):
            layer.feed_forward.experts = make(layer.feed_forward.experts, comm, backward)
