"""Hierarchical context parallelism (USP, Fang and Zhao 2024, arXiv:2405.07719; Megatron-LM's
``--cp-comm-type a2a+p2p``): cp = Ulysses x ring. Ulysses' all-to-alls run inside groups of
``--cp-ulysses-size`` neighbouring cp ranks (one node: the all-to-all stays on its fast links) and turn the
group's sequence shards into the group's whole share of the sequence for heads/u; ring attention across the
groups passes those K/V blocks around, one hop per group (the slow links carry K/V blocks, overlapped with
attention, not all-to-alls). The ring's zigzag balance holds between the groups: group o holds zigzag chunks
o and 2r-1-o of 2r, each of its u ranks a u-th of both (``cp_modes``' positions), so after the all-to-all,
in position order, every rank of the group holds the group's zigzag pair.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comm, Comms
from parallelisms.parallel.context import RingAttentionCore, UlyssesAttentionCore


class _InPositionOrder(nn.Module):
    """``inner`` on q/k/v whose sequence is reordered by ``order`` (the all-to-all's concatenation, rank by
    rank, into position order); the output goes back to the concatenation's order."""

    def __init__(self, inner: nn.Module, order: torch.Tensor):
        super().__init__()
        self.inner, self.order, self.inverse = inner, order, torch.argsort(order)

    def forward(self, q, k, v):
        return self.inner(*(t[:, :, self.order] for t in (q, k, v)))[:, :, self.inverse]


def _split_cp(comms: Comms, ulysses: int) -> tuple[Comm, Comm]:
    """(the ring across groups, Ulysses inside one): cp rank o * u + i is rank i of its group, rank o of its
    ring. The sub-meshes are made once per mesh (every rank makes them, in the same order)."""
    if "cp_inner" not in comms.meshes and "cp" in comms.meshes:  # (a one-process build has no cp mesh)
        cp = comms.meshes["cp"]
        split = cp._unflatten(0, (cp.size() // ulysses, ulysses), ("cp_outer", "cp_inner"))
        comms.meshes["cp_outer"], comms.meshes["cp_inner"] = split["cp_outer"], split["cp_inner"]
    return comms["cp_outer"], comms["cp_inner"]


def hierarchical_core(comms: Comms, held: list[torch.Tensor], inner: nn.Module, parallel) -> nn.Module:
    u = min(parallel.cp_ulysses_size, comms["cp"].size)
    ring_comm, ulysses_comm = _split_cp(comms, u)
    group = comms["cp"].rank // u
    arrived = torch.cat([held[group * u + i] for i in range(u)])  # the all-to-all's output, rank by rank
    order = torch.argsort(arrived)
    ring = RingAttentionCore(ring_comm, arrived[order])
    return UlyssesAttentionCore(ulysses_comm, _InPositionOrder(ring, order))
