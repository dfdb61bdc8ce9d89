"""Expert load: the tokens routed to each expert and to each expert-parallel rank, their imbalance, and the
assignments the capacity limit dropped, per step of a mixture-of-experts run (DeepSeek-V3's EPLB balances on the
same figures). The all-to-all wait an overloaded owner causes is the straggler report's ``ep`` dimension.

After each step every rank adds up its MoE layers' last forward (``MoE.tokens_per_expert``: the tokens it routed,
the whole step's without a pipeline or gradient accumulation, else its last microbatch's); at the end one
all-reduce over the world (outside the timed steps) sums them, divided by the tensor-parallel degree (tensor-parallel
peers route the same tokens). A rank's tokens are those of the experts it holds: the n_experts / ep it owns, or
under ``--ep-balance measured`` the copies its slots hold (a copy takes an equal share of its expert's tokens).
"""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.model.moe import MoE
from parallelisms.parallel.ep_placement import rank_loads


class ExpertLoad:
    """Running per-expert token counts of this rank's MoE layers (see the module docstring)."""

    def __init__(self, model: nn.Module, ep: int):
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        self.ep = ep
        experts = self.layers[0].n_experts if self.layers else 0
        self.totals = torch.zeros(experts + 2, dtype=torch.float64)  # per expert, then dropped, then routed
        self.rank_totals = torch.zeros(ep, dtype=torch.float64)  # per ep rank, by where the experts sit
        self.worst = 0.0  # the largest max/mean over experts of one step on this rank
        self.steps = 0

    def after_step(self) -> None:
        ran = [m for m in self.layers if m.tokens_per_expert is not None]
        if not ran:
            return
        counts = sum(m.tokens_per_expert.double().cpu() for m in ran)
        dropped = sum(m.dropped for m in ran)
        self.totals += torch.cat([counts, torch.tensor([float(dropped), float(counts.sum()) + dropped])])
        for m in ran:
            layer = m.tokens_per_expert.double().cpu()
            placement = getattr(m.experts, "placement", None)  # --ep-balance measured's slots
            self.rank_totals += (layer.view(self.ep, -1).sum(1) if placement is None else
                                 torch.tensor(rank_loads(layer.tolist(), placement, self.ep), dtype=torch.float64))
        self.worst = max(self.worst, float(counts.max() / counts.mean().clamp_min(1e-12)))
        self.steps += 1

    def report(self, comms, tp: int) -> dict | None:
        """Every rank calls it (one all-reduce over the world); per step: tokens per expert and per ep rank,
        max/mean imbalance of both, the share of assignments dropped by capacity."""
        if not self.layers:
            return None
        with comms.ledger.in_phase("report"):
            every = comms["world"].all_reduce(torch.cat([self.totals, self.rank_totals])) / tp
        totals, steps = every[:len(self.totals)], max(1, self.steps)
        experts = totals[:-2] / steps
        ranks = every[len(self.totals):] / steps
        return {"tokens_per_expert": experts.tolist(), "tokens_per_ep_rank": ranks.tolist(),
                "expert_imbalance": float(experts.max() / experts.mean().clamp_min(1e-12)),
                "ep_rank_imbalance": float(ranks.max() / ranks.mean().clamp_min(1e-12)),
                "worst_step_expert_imbalance_rank0": self.worst,
                "dropped_per_step": float(totals[-2] / steps),
                "dropped_fraction": float(totals[-2] / totals[-1].clamp_min(1.0))}
