"""Expert-parallel balance by measured load (``--ep-balance measured``): experts placed on the expert-parallel
ranks by the tokens routed to them, with redundant copies of the hottest ones, as DeepSeek's EPLB does
(DeepSeek-V3, 2024; :mod:`parallelisms.parallel.ep_placement` computes the placement).

With experts split evenly (:mod:`parallelisms.parallel.expert`), a rank owning hot experts receives most of the
dispatched tokens, and every other rank waits for it at the combine all-to-all. Here each MoE layer's experts
sit in ``n_experts / ep + --ep-redundant`` slots per rank (:class:`BalancedExperts`), a physical slot holding a
copy of a logical expert. The tokens a rank routes to an expert with several copies are split between them
(near-equal contiguous parts, the remainder rotated by rank), and dispatched to the slots' ranks as usual.

Each rank counts the tokens it routes per expert and layer (training forwards only); after ``MEASURE_STEPS``
steps, and again every ``--ep-rebalance-every`` steps, one all-reduce over the world gives every rank the same
counts and so the same new placement. Moving an expert moves its weights and AdamW's moments with one uneven
all-to-all per layer over ``ep`` (a rank keeps what it holds already). Both run between steps, outside their
timing, as ledger phase ``setup`` (one-off, like DDP's bucket rebuild), so the per-step figures leave them out.

Training stays equal to single-process training (:class:`ExpertBalance`, a ``GradSync`` around the layout's):
copies of one expert are one logical expert, so after the layout's reductions their gradients are summed over
``ep`` (one all-reduce of the replicated experts' gradients) and every copy steps with the same gradient and the
same AdamW state; the gradient norm counts each expert once (its first copy), checkpoints present each expert as
its box of the plain model's tensor (a box two ranks hold is written once) and the placement in the data state,
and the full state dict gathers each expert's first copy.
"""

from __future__ import annotations

import functools
import math

import torch

from parallelisms.comm import Comms
from parallelisms.model.moe import GroupedExperts
from parallelisms.parallel.common import mark_sharded
from parallelisms.parallel.ep_placement import canonical, place, rank_loads, valid
from parallelisms.parallel.expert import ExpertParallelExperts, apply_expert_parallel
from parallelisms.parallel.placement import Piece

WEIGHTS = ("w_gate", "w_up", "w_down")
MEASURE_STEPS = 2  # steps on the even placement before the first measured one


class BalancedExperts(ExpertParallelExperts):
    """This rank's slots of a layer's experts under a placement (see the module docstring); the same dispatch
    and combine as :class:`ExpertParallelExperts`, over slots instead of experts."""

    def __init__(self, full: GroupedExperts, comm, backward_comm=None, redundant: int = 0):
        super().__init__(full, comm, backward_comm)
        self.n_experts = full.w_gate.shape[0]
        self.load = torch.zeros(self.n_experts, dtype=torch.float64)  # tokens routed here since the last placement
        self.use(canonical(self.n_experts, comm.size, redundant))
        for name in WEIGHTS:  # sharded over ep, reassembled by ExpertBalance (not by concatenation)
            slots = torch.nn.Parameter(getattr(full, name).detach()[self.mine()].clone())
            setattr(self, name, mark_sharded(slots, comm.name, None))

    def use(self, placement: list[int]) -> None:
        """Take ``placement`` (physical slot -> expert) as the layer's; the weights are moved by the caller."""
        self.placement = list(placement)
        self.local = len(placement) // self.comm.size  # slots per rank: what the dispatch splits by
        self.copies = [[p for p, e in enumerate(placement) if e == expert] for expert in range(self.n_experts)]

    def mine(self) -> list[int]:
        """The experts of this rank's slots."""
        return self.placement[self.comm.rank * self.local:(self.comm.rank + 1) * self.local]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: rows sorted by logical expert, ``counts[e]`` for expert e; each expert's rows split over its
        copies, the rows re-sorted by physical slot for the dispatch, and the outputs put back."""
        if torch.is_grad_enabled():
            self.load += counts.detach().double().cpu()
        rows, slot_ids, sizes = [0] * len(self.placement), [], []
        for expert, n in enumerate(counts.tolist()):
            slots = self.copies[expert]
            base, extra = divmod(n, len(slots))
            for j, slot in enumerate(slots):
                rows[slot] = base + ((j - self.comm.rank) % len(slots) < extra)
                slot_ids.append(slot)
                sizes.append(rows[slot])
        slot_of = torch.repeat_interleave(torch.tensor(slot_ids, device=x.device), torch.tensor(sizes, device=x.device))
        order = torch.argsort(slot_of, stable=True)
        out = super().forward(x[order], torch.tensor(rows, dtype=counts.dtype, device=counts.device))
        return torch.empty_like(out).index_copy(0, order, out)


def apply_balanced_experts(model, comm, backward=None, redundant: int = 0) -> list[BalancedExperts]:
    """Expert parallelism with placed experts (``redundant`` extra slots per rank); returns the layers' modules."""
    apply_expert_parallel(model, comm, backward, make=functools.partial(BalancedExperts, redundant=redundant))
    return [m for m in model.modules() if isinstance(m, BalancedExperts)]


class ExpertBalance:
    """``inner`` (the layout's ``GradSync``) with the copies of each expert kept one expert, and the placement
    measured and moved between steps (see the module docstring); every other call goes to ``inner``."""

    def __init__(self, inner, model, comms: Comms, redundant: int, every: int):
        self.inner, self.comms, self.ep = inner, comms, comms["ep"]
        self.layers = [m for m in model.modules() if isinstance(m, BalancedExperts)]
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.redundant, self.every = redundant, every
        self.history: list[int] = []  # the step after which each measured placement was taken
        self.measured: list[dict] = []  # per rebalance: the ranks' loads before and after (all layers summed)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    # -- one logical expert per set of copies ------------------------------------------------------------
    @torch.no_grad()
    def finish(self) -> None:
        """The layout's reductions, then every copy's gradient becomes the sum over the expert's copies."""
        self.inner.finish()
        parts = []  # (layer, weight, replicated expert -> row, their summed gradients)
        for m in self.layers:
            shared = {e: i for i, e in enumerate(e for e in range(m.n_experts) if len(m.copies[e]) > 1)}
            for name in WEIGHTS if shared else ():
                p = getattr(m, name)
                total = p.new_zeros((len(shared), *p.shape[1:]))
                for slot, e in enumerate(m.mine()):
                    if e in shared and p.grad is not None:
                        total[shared[e]] += p.grad[slot]
                parts.append((m, p, shared, total))
        if not parts:
            return
        summed = self.ep.all_reduce(torch.cat([t.reshape(-1) for *_, t in parts]))
        offset = 0
        for m, p, shared, total in parts:
            total = summed[offset:offset + total.numel()].view_as(total)
            offset += total.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            for slot, e in enumerate(m.mine()):
                if e in shared:
                    p.grad[slot].copy_(total[shared[e]])

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The inner norm with every copy but an expert's first zeroed: each expert counts once."""
        saved = []
        for m in self.layers:
            first = m.comm.rank * m.local
            later = [slot for slot, e in enumerate(m.mine()) if m.copies[e][0] != first + slot]
            for name in WEIGHTS if later else ():
                grad = getattr(m, name).grad
                if grad is not None:
                    saved.append((grad, later, grad[later].clone()))
                    grad[later] = 0
        norm = self.inner.grad_norm()
        for grad, later, copy in saved:
            grad[later] = copy
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The layout's full parameters, each layer's experts gathered over ep and taken from their first copies."""
        state = self.inner.full_state_dict()
        for m in self.layers:
            first = torch.tensor([copies[0] for copies in m.copies])
            for name in WEIGHTS:
                p = getattr(m, name)
                state[self.names[id(p)]] = self.ep.all_gather(p.detach().contiguous())[first.to(p.device)].cpu().clone()
        return state

    def placements(self) -> list:
        """The layout's placements, each slot of an expert weight the box of its expert in the plain model's."""
        slots = {id(getattr(m, name)): m for m in self.layers for name in WEIGHTS}
        out = []
        for param, pieces in self.inner.placements():
            m = slots.get(id(param))
            if m is not None:
                row = tuple(param.shape[1:])
                pieces = [Piece(self.names[id(param)], (m.n_experts, *row), (e,) + (0,) * len(row), (1, *row),
                                slot * math.prod(row), (1, *row)) for slot, e in enumerate(m.mine())]
            out.append((param, pieces))
        return out

    # -- measuring and moving ----------------------------------------------------------------------------
    def rebalance_if_due(self, step: int, optimizers) -> None:
        """After step ``step`` (0-based), on every rank: re-place the experts when due (a collective)."""
        done = step + 1
        if done == MEASURE_STEPS or (self.every and done > MEASURE_STEPS and (done - MEASURE_STEPS) % self.every == 0):
            self._rebalance(optimizers)
            self.history.append(done)

    def _rebalance(self, optimizers) -> None:
        mine = torch.stack([m.load for m in self.layers])
        with self.comms.ledger.in_phase("setup"):
            loads = self.comms["world"].all_reduce(mine.clone()) if self.comms["world"].size > 1 else mine
        for m in self.layers:
            m.load.zero_()
        new = [place(layer.tolist(), self.ep.size, self.redundant) for layer in loads]
        before = [rank_loads(layer.tolist(), m.placement, self.ep.size) for layer, m in zip(loads, self.layers)]
        after = [rank_loads(layer.tolist(), p, self.ep.size) for layer, p in zip(loads, new)]
        self.measured.append({"tokens_per_expert": loads.sum(0).tolist(),
                              "rank_tokens_before": [sum(r) for r in zip(*before)],
                              "rank_tokens_after": [sum(r) for r in zip(*after)]})
        self._move(new, optimizers)

    @torch.no_grad()
    def _move(self, placements: list[list[int]], optimizers) -> None:
        """Each layer to its new placement: weights and AdamW's moments (any state shaped like the weight)."""
        with self.comms.ledger.in_phase("setup"):
            for m, new in zip(self.layers, placements):
                if new != m.placement:
                    tensors = [t for name in WEIGHTS for t in _with_state(getattr(m, name), optimizers)]
                    _move_layer(m, new, tensors, self.ep)
                    m.use(new)

    # -- the checkpoint's data state and the report --------------------------------------------------------
    def state_dict(self) -> dict:
        return {"ep_placement": [m.placement for m in self.layers]}

    def load_state_dict(self, state, optimizers) -> None:
        """Continue with a saved placement when it fits this run (same layers, experts, ep degree and slots): the
        weights and moments just loaded for the even placement move to it. Otherwise start even and measure."""
        saved = state.get("ep_placement") if isinstance(state, dict) else None
        if isinstance(saved, list) and len(saved) == len(self.layers) and all(
                valid(p, m.n_experts, self.ep.size, len(m.placement)) for p, m in zip(saved, self.layers)):
            self._move([list(p) for p in saved], optimizers)

    def report(self) -> dict:
        """The placement in use per layer, when it was measured, and each measurement's rank loads."""
        out = {"redundant": self.redundant, "every": self.every, "placements": [m.placement for m in self.layers],
               "measured_after_steps": self.history, "measurements": self.measured}
        if self.measured:
            last = self.measured[-1]
            out["rank_imbalance_before"] = _imbalance(last["rank_tokens_before"])
            out["rank_imbalance_after"] = _imbalance(last["rank_tokens_after"])
        return out


def _imbalance(loads: list[float]) -> float:
    return max(loads) / max(sum(loads) / len(loads), 1e-12)


def _with_state(param: torch.Tensor, optimizers) -> list[torch.Tensor]:
    """``param`` and every optimizer state tensor shaped like it (AdamW's moments), in a fixed order."""
    out = [param]
    for opt in optimizers:
        state = opt.state.get(param) or {}
        out += [state[k] for k in sorted(state) if torch.is_tensor(state[k]) and state[k].shape == param.shape]
    return out


def _move_layer(m: BalancedExperts, new: list[int], tensors: list[torch.Tensor], ep) -> None:
    """Fill this rank's slots under placement ``new`` from the slots under ``m.placement``: what the rank held
    already stays, the rest arrives by one uneven all-to-all (each expert from its first old copy)."""
    ranks, slots, me = ep.size, m.local, ep.rank
    old = m.placement

    def source(rank: int, expert: int) -> tuple[int, int]:
        held = [p for p in range(rank * slots, (rank + 1) * slots) if old[p] == expert]
        p = held[0] if held else m.copies[expert][0]
        return p // slots, p % slots
    packed = torch.cat([t.detach().reshape(slots, -1) for t in tensors], dim=1)
    sends = [[s for i in range(slots) for r, s in [source(d, new[d * slots + i])] if r == me]
             if d != me else [] for d in range(ranks)]
    wanted = [source(me, new[me * slots + i]) for i in range(slots)]
    received = ep.all_to_all(packed[[s for rows in sends for s in rows]],
                             [sum(r == src for r, _ in wanted) if src != me else 0 for src in range(ranks)],
                             [len(rows) for rows in sends])
    start = [0] * ranks
    for src in range(1, ranks):
        start[src] = start[src - 1] + (sum(r == src - 1 for r, _ in wanted) if src - 1 != me else 0)
    fresh = []
    for r, s in wanted:
        if r == me:
            fresh.append(packed[s])
        else:
            fresh.append(received[start[r]])
            start[r] += 1
    fresh = torch.stack(fresh)
    column = 0
    for t in tensors:
        width = t[0].numel()
        t.detach().copy_(fresh[:, column:column + width].reshape(t.shape))
        column += width
