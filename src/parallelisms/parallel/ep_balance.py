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
counts and so the same new placement of every layer (a pipeline stage moves its own; DualPipe's two copies of a
stage count into the same layer and move alike). Moving an expert moves its weights (the master weights under bf16,
whose working copies the engine casts and gathers from them again) and AdamW's moments with one uneven all-to-all
per layer over ``ep`` (a rank keeps what it holds already). Both run between steps, outside their timing, as ledger
phase ``setup`` (one-off, like DDP's bucket rebuild), so the per-step figures leave them out.

Training stays equal to single-process training (:class:`ExpertBalance`, a ``GradSync`` around the layout's):
copies of one expert are one logical expert, so after the layout's reductions their gradients are summed over
``ep`` (one all-reduce of the replicated experts' gradients) and every copy steps with the same gradient and the
same AdamW state; the gradient norm counts each expert once (its first copy). PipeDream (Narayanan et al., 2019),
which updates each stage after every microbatch from its schedule's hooks, does both per update for the stage's
layers (:meth:`ExpertBalance.finish_stage`, :meth:`ExpertBalance.stage_grad_norm`); its placement moves between
steps too, when the window has drained and no weight version is stashed. Checkpoints present each expert as
its box of the plain model's tensor (a box two ranks hold is written once) and, in the data state, every layer's
placement with the tokens counted since it (a resumed run continues as the uninterrupted one), and the full state
dict gathers each expert's first copy.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from parallelisms.comm import Comms
from parallelisms.model.moe import GroupedExperts
from parallelisms.options import Balance
from parallelisms.parallel.common import mark_sharded
from parallelisms.parallel.ep_placement import canonical, place, rank_loads, replicated, slots_per_rank, valid
from parallelisms.parallel.ep_slots import WEIGHTS, Holder, engines_of, holders
from parallelisms.parallel.expert import ExpertParallelExperts, apply_expert_parallel, unsort
from parallelisms.parallel.placement import Piece

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
        self.local = slots_per_rank(placement, self.comm.size)
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
        return unsort(out, order)


def expert_parallel_swap(model, comms: Comms, parallel, train) -> None:
    """The registry's transform (:func:`parallelisms.train_setup.parallelize`): when ``--ep`` is above 1, the
    experts go to their owners, evenly (:func:`~parallelisms.parallel.expert.apply_expert_parallel`) or, with
    ``--ep-balance measured``, placed by measured load (:func:`apply_balanced_experts`)."""
    if parallel.dims.ep > 1 and parallel.ep_balance is Balance.MEASURED:
        apply_balanced_experts(model, comms["ep"], comms["ep_bwd"], parallel.ep_redundant)
    elif parallel.dims.ep > 1:
        apply_expert_parallel(model, comms["ep"], comms["ep_bwd"])


def apply_balanced_experts(model, comm, backward=None, redundant: int = 0) -> list[BalancedExperts]:
    """Expert parallelism with placed experts (``redundant`` extra slots per rank); returns the layers' modules."""
    apply_expert_parallel(model, comm, backward, make=functools.partial(BalancedExperts, redundant=redundant))
    return [m for m in model.modules() if isinstance(m, BalancedExperts)]


class ExpertBalance:
    """``inner`` (the layout's ``GradSync``) with the copies of each expert kept one expert, and the placement
    measured and moved between steps (see the module docstring); every other call goes to ``inner``."""

    def __init__(self, inner, stages: dict, copies: set, comms: Comms, redundant: int, every: int,
                 per_update: bool = False):
        """``stages``: this rank's modules (the model, or its pipeline stages), DualPipe's second ``copies``
        among them; ``per_update``: PipeDream's schedule updates each stage after every microbatch
        (:meth:`finish_stage`), so the step's end has no gradient left to sum."""
        self.inner, self.comms, self.ep, self.per_update = inner, comms, comms["ep"], per_update
        self.layers, self.index, self.first = [], [], []  # each layer's index in the model; not a second copy
        self.stage = []  # each layer's stage
        self.prefix = {}  # the engines name the parameters as the stage (the plain model's names)
        for s in sorted(stages):
            self.prefix.update({id(m): name for name, m in stages[s].named_modules()})
            for key, block in stages[s].layers.items():
                for m in block.modules():
                    if isinstance(m, BalancedExperts):
                        self.layers.append(m)
                        self.index.append(int(key))
                        self.stage.append(s)
                        self.first.append(s not in copies)
        cfg = next(iter(stages.values())).cfg
        self.shape = (cfg.n_layers, cfg.n_experts)
        # every layer's placement (each is a MoE layer), the same on every rank, which computes them all from the
        # same counts: what the checkpoint and the report hold, whichever stages a rank runs
        self.all = [canonical(cfg.n_experts, self.ep.size, redundant)] * cfg.n_layers
        self.carried = torch.zeros(self.shape, dtype=torch.float64)  # counts a resumed run takes over (rank 0)
        self._held: list[list[Holder]] | None = None
        self.redundant, self.every = redundant, every
        self.history: list[int] = []  # the step after which each measured placement was taken
        self.measured: list[dict] = []  # per rebalance: the ranks' loads before and after (all layers summed)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    # -- one logical expert per set of copies ------------------------------------------------------------
    def _holders(self) -> list[list[Holder]]:
        """Each layer's holders (:mod:`parallelisms.parallel.ep_slots`), found once the engines exist."""
        if self._held is None:
            self._held = [holders(m, engines_of(self.inner)) for m in self.layers]
        return self._held

    def finish(self) -> None:
        """The layout's reductions, then every copy's gradient the sum over its expert's copies (:meth:`_sum_copies`;
        under PipeDream each update did so for its stage)."""
        self.inner.finish()
        if not self.per_update:
            self._sum_copies(range(len(self.layers)))

    def finish_stage(self, stage: int) -> None:
        """PipeDream's update of ``stage`` (:class:`~parallelisms.parallel.pipeline.pipedream.WeightStashing`): the
        stage's reduction, then its layers' copies summed, as :meth:`finish` does for the whole step."""
        self.inner.finish_stage(stage)
        self._sum_copies(self._of_stage(stage))

    def stage_grad_norm(self, stage: int, params) -> torch.Tensor:
        """PipeDream's norm of ``stage`` (the inner per-stage norm), each of its experts counted once."""
        with self._first_copies_only(self._of_stage(stage)):
            return self.inner.stage_grad_norm(stage, params)

    def _of_stage(self, stage: int) -> list[int]:
        return [i for i, s in enumerate(self.stage) if s == stage]

    @torch.no_grad()
    def _sum_copies(self, which) -> None:
        """Every copy's gradient in layers ``which`` (indices) becomes the sum over the expert's copies: each rank
        adds the part of its copies it holds (a flat shard holds a range of the slots) into one row per replicated
        expert, summed over ep and, where a flat engine shards the slots over ``ep_replicate``, over those ranks.
        The ranks of an ep group hold the same layers, so they make the same calls."""
        parts = []  # (layer's holders, replicated expert -> row, their summed gradients [row, weights' elements])
        for m, held in ((self.layers[i], self._holders()[i]) for i in which):
            shared = {e: i for i, e in enumerate(replicated(m.placement, m.n_experts))}
            if not shared:
                continue
            total = held[0].param.new_zeros((len(shared), sum(h.per_slot for h in held)))
            for grad, row in _copies(m, held, shared, total):
                row += grad  # views: the total's row piece and the gradient's
            parts.append((m, held, shared, total))
        if not parts:
            return
        summed = self.ep.all_reduce(torch.cat([t.reshape(-1) for *_, t in parts]))
        if any(h.comm is not None and h.comm.size > 1 for _, held, _, _ in parts for h in held):
            summed = self.comms["ep_replicate"].all_reduce(summed)  # the ranges of the other shards
        offset = 0
        for m, held, shared, total in parts:
            total = summed[offset:offset + total.numel()].view_as(total)
            offset += total.numel()
            for grad, row in _copies(m, held, shared, total):
                grad.copy_(row)

    def grad_norm(self) -> torch.Tensor:
        """The inner norm, each expert counted once."""
        with self._first_copies_only(range(len(self.layers))):
            return self.inner.grad_norm()

    @contextlib.contextmanager
    def _first_copies_only(self, which):
        """Every copy but an expert's first zeroed in layers ``which`` while entered (a norm then counts each
        expert once), the gradients restored after."""
        saved = []
        for m, held in ((self.layers[i], self._holders()[i]) for i in which):
            first = m.comm.rank * m.local
            for slot in [slot for slot, e in enumerate(m.mine()) if m.copies[e][0] != first + slot]:
                for h in held:
                    at, _, count = h.span(slot)
                    if count and h.param.grad is not None:
                        piece = h.param.grad.reshape(-1)[at:at + count]
                        saved.append((piece, piece.clone()))
                        piece.zero_()
        try:
            yield
        finally:
            for piece, copy in saved:
                piece.copy_(copy)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The layout's full parameters (each rank's slots, as the layout gathers them), each layer's experts
        gathered over ep and taken from their first copies."""
        state = self.inner.full_state_dict()
        for m, held, first in zip(self.layers, self._holders(), self.first):
            if not first:  # DualPipe's second copy of a stage: the first copy on another rank stands for it
                continue
            for name in WEIGHTS:
                slots = state[self.name_of(m, name)].to(held[0].param.device).contiguous()
                state[self.name_of(m, name)] = self.ep.all_gather(slots)[[copies[0] for copies in m.copies]].cpu()
        return state

    def name_of(self, m: BalancedExperts, weight: str) -> str:
        return f"{self.prefix[id(m)]}.{weight}"

    def placements(self) -> list:
        """The layout's placements, each slot of an expert weight (a box in its weight, or in a flat shard) the
        box of its expert in the plain model's tensor."""
        slots = {self.name_of(m, name): m for m in self.layers for name in WEIGHTS}
        out = []
        for param, pieces in self.inner.placements():
            mapped = []
            for piece in pieces:
                m = slots.get(piece.name)
                mapped += [piece] if m is None else _per_expert(piece, m)
            out.append((param, mapped))
        return out

    # -- measuring and moving ----------------------------------------------------------------------------
    def rebalance_if_due(self, step: int, optimizers) -> None:
        """After step ``step`` (0-based), on every rank: re-place the experts when due (a collective)."""
        done = step + 1
        if done == MEASURE_STEPS or (self.every and done > MEASURE_STEPS and (done - MEASURE_STEPS) % self.every == 0):
            self._rebalance(optimizers)
            self.history.append(done)

    def _rebalance(self, optimizers) -> None:
        every = self._counted("setup")
        new = [place(layer.tolist(), self.ep.size, self.redundant) for layer in every]
        before = [rank_loads(layer.tolist(), p, self.ep.size) for layer, p in zip(every, self.all)]
        after = [rank_loads(layer.tolist(), p, self.ep.size) for layer, p in zip(every, new)]
        self.measured.append({"tokens_per_expert": every.sum(0).tolist(),
                              "rank_tokens_before": [sum(r) for r in zip(*before)],
                              "rank_tokens_after": [sum(r) for r in zip(*after)]})
        for m in self.layers:
            m.load.zero_()
        self.carried.zero_()
        self.all = new
        self._move([new[i] for i in self.index], optimizers)

    def _counted(self, phase: str) -> torch.Tensor:
        """The tokens routed to each expert of each layer since the last placement, summed over every rank (one
        all-reduce over the world: pipeline stages hold different layers, DualPipe's two copies of a layer add
        up), with the counts a resumed run took over from its checkpoint."""
        mine = self.carried.clone() if self.comms["world"].rank == 0 else torch.zeros(self.shape, dtype=torch.float64)
        for i, m in zip(self.index, self.layers):
            mine[i] += m.load
        with self.comms.ledger.in_phase(phase):
            return self.comms["world"].all_reduce(mine) if self.comms["world"].size > 1 else mine

    @torch.no_grad()
    def _move(self, placements: list[list[int]], optimizers) -> None:
        """Each layer to its new placement: weights and AdamW's moments (any state shaped like the parameter
        holding them), as [slots, elements] rows (a flat shard's gathered over its shard group first); then the
        flat engines' full buffers are gathered again from the moved shards."""
        engines = engines_of(self.inner)
        for engine in engines:  # an overlapped gather of the last update lands before anything moves
            getattr(engine, "_finish_updates", lambda: None)()
        moved = False
        with self.comms.ledger.in_phase("setup"):
            for m, held, new in zip(self.layers, self._holders(), placements):
                if new == m.placement:
                    continue
                pairs = [(h, t) for h in held for t in _with_state(h.param, optimizers)]
                rows = [h.rows(t, m.local) for h, t in pairs]
                _move_layer(m, new, rows, self.ep)
                for (h, t), r in zip(pairs, rows):
                    h.put(t, r)
                m.use(new)
                moved = True
            if moved:  # the same on every rank of a stage: they hold the same layers and placements
                for engine in engines:
                    if hasattr(engine, "units"):
                        engine.after_step()

    # -- the checkpoint's data state and the report --------------------------------------------------------
    def state_dict(self) -> dict:
        """Every layer's placement and the tokens counted since it was taken (a collective: every rank saves)."""
        return {"ep_placement": self.all, "ep_counted": self._counted("checkpoint").tolist()}

    def load_state_dict(self, state, optimizers) -> None:
        """Continue with a saved placement when it fits this run (same layers, experts, ep degree and slots): the
        weights and moments just loaded for the even placement move to it. Otherwise start even and measure. The
        counts since the saved placement carry on, so the next one is the uninterrupted run's."""
        state = state if isinstance(state, dict) else {}
        saved, counted = state.get("ep_placement"), state.get("ep_counted")
        if isinstance(saved, list) and len(saved) == self.shape[0] and all(
                valid(p, self.shape[1], self.ep.size, len(self.all[0])) for p in saved):
            self.all = [list(p) for p in saved]
            self._move([self.all[i] for i in self.index], optimizers)
        if self.comms["world"].rank == 0 and isinstance(counted, list) and len(counted) == self.shape[0] and all(
                isinstance(row, list) and len(row) == self.shape[1] for row in counted):
            self.carried = torch.tensor(counted, dtype=torch.float64)

    def report(self) -> dict:
        """The placement in use per layer, when it was measured, and each measurement's rank loads."""
        out = {"redundant": self.redundant, "every": self.every, "placements": self.all,
               "measured_after_steps": self.history, "measurements": self.measured}
        if self.measured:
            last = self.measured[-1]
            out["rank_imbalance_before"] = _imbalance(last["rank_tokens_before"])
            out["rank_imbalance_after"] = _imbalance(last["rank_tokens_after"])
        return out


def _grad(param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient, zeros where none arrived (every rank then adds and writes alike)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _copies(m: BalancedExperts, held: list[Holder], shared: dict, total: torch.Tensor):
    """For each piece of a replicated expert's copy this rank holds: (its gradient's piece, the same elements'
    piece of ``total``'s row for the expert), both views, in the holders' and slots' order."""
    column = 0
    for h in held:
        grad = _grad(h.param).reshape(-1)
        for slot, e in enumerate(m.mine()):
            at, within, count = h.span(slot)
            if e in shared and count:
                yield grad[at:at + count], total[shared[e], column + within:column + within + count]
        column += h.per_slot


def _per_expert(piece: Piece, m: BalancedExperts) -> list[Piece]:
    """A box of ``m``'s slot weight (rows s0.. of a [slots, ...] tensor) as one box per slot, each in its expert's
    row of the plain model's [n_experts, ...] tensor."""
    inner = math.prod(piece.box_shape[1:])
    mine = m.mine()
    return [Piece(piece.name, (m.n_experts, *piece.full_shape[1:]), (mine[piece.offsets[0] + t], *piece.offsets[1:]),
                  (1, *piece.sizes[1:]), piece.flat_lo + t * inner, (1, *piece.box_shape[1:]))
            for t in range(piece.sizes[0])]


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
