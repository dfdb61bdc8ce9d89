"""The pipeline-parallel parts of a training step: the stages cut from the plain model, the schedule as the
step's forward and backward (:class:`PipelineSchedule`), and the gradient sync over data parallelism and
between DualPipe's two copies (:class:`StageGradients`, a ``GradSync``); clip and step are the common ones.

Layout: ``comms["pp"]`` carries activations and gradients between stages, ``comms["dp"]`` the gradient
all-reduce of each stage (a reduce-scatter under ZeRO-1: ``zero.py``) (one flat buffer per stage, launched asynchronously right after that stage's
last weight-gradient work of the step, so it overlaps the rest of the schedule, and waited before the
optimizer). DualPipe (DeepSeek-V3 report) keeps stage ``s`` on ranks ``s`` (path 0) and ``pp-1-s``
(path 1); the two copies exchange gradient buffers and both add, so they stay identical.

With tensor parallelism (Megatron-LM's PP x TP) the model is made tensor-parallel over ``comms["tp"]``
before it is cut, so every stage holds tensor-parallel modules; ``comms["pp"]`` joins the ranks of one tp
coordinate, so each TP rank exchanges its own copy of the activations with its peer in the next stage, or,
under sequence parallelism, its sequence shard (1/tp of the bytes).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
from torch import nn

from parallelisms.comm import Comm, Comms
from parallelisms.config import ParallelConfig, TrainConfig
from parallelisms.data.loader import microbatches
from parallelisms.model.numerics import upcast
from parallelisms.parallel.common import gather_full, global_grad_norm, mark_sharded, sharded_over
from parallelisms.parallel.data import Bucket
from parallelisms.parallel.grad_sync import LocalGradients
from parallelisms.parallel.placement import tensor_pieces
from parallelisms.parallel.pipeline.executor import Executor, WeightGradStore
from parallelisms.parallel.pipeline.partition import balanced_bounds, equal_bounds, profile_costs
from parallelisms.parallel.pipeline.schedules import Schedule, build_schedule
from parallelisms.parallel.pipeline.simulate import Times, simulate
from parallelisms.parallel.pipeline.stage import add_mirror_copies, build_stages


def schedule_for(parallel: ParallelConfig) -> Schedule:
    """The schedule a layout runs (microbatches default to 2 x pp; chunks only for interleaved)."""
    pp = parallel.dims.pp
    chunks = parallel.chunks if parallel.schedule == "interleaved" else None
    return build_schedule(parallel.schedule, pp, parallel.microbatches or 2 * pp, chunks)


def measured_bounds(model_cfg, parallel: ParallelConfig, cfg: TrainConfig, comms: Comms) -> list[int]:
    """Stage bounds minimising the slowest stage's measured forward + backward time. Rank 0 profiles one
    microbatch per part and every rank takes its figures, so all ranks cut the model the same way."""
    schedule = schedule_for(parallel)
    rows = cfg.global_batch // parallel.dims.dp // schedule.microbatches
    costs = profile_costs(model_cfg, rows, cfg.seq_len) if comms["world"].rank == 0 else None
    with comms.ledger.in_phase("setup"):
        costs = comms["world"].all_gather_object(costs)[0]
    return balanced_bounds(*costs, schedule.num_stages)


class StageGradients(LocalGradients):
    """The pipeline's ``GradSync`` without sharding: flat gradient buffers per stage, all-reduced over the
    data-parallel ranks as soon as the stage's backward of the step is done (:meth:`stage_done`, called by
    the executor), and DualPipe's two copies of a stage exchanging their buffers. Without either, plain
    gradients. Expert weights (sharded over ``ep``) have a buffer of their own, summed over the ranks holding
    the same experts only, and like every gradient divided by the data-parallel size. The global norm sums
    stages over ``pp`` (DualPipe's second copies are left out of it; the clip still scales them)."""

    def __init__(self, stages: dict[int, nn.Module], copies: set[int], comms: Comms, data_dim: str | None = "dp"):
        super().__init__(nn.ModuleList(stages.values()), comms)
        self.stages, self.copies = stages, copies
        # data_dim None: no average here (PipeDream averages each of its updates)
        self.dp_comm, self.pp_comm = comms[data_dim] if data_dim else Comm("none"), comms["pp"]
        self.pending: list = []
        self.buckets: dict[int, list[Bucket]] = {}
        if self.dp_comm.size > 1 or copies:
            for s, st in stages.items():
                named = list(st.named_parameters())
                experts = [(n, p) for n, p in named if "ep" in sharded_over(p)]
                dense = [(n, p) for n, p in named if "ep" not in sharded_over(p)]
                self.buckets[s] = [Bucket([p for _, p in group], [n for n, _ in group], comm)
                                   for group, comm in ((dense, self.dp_comm), (experts, comms["ep_replicate"]))
                                   if group]

    def zero_grad(self) -> None:
        if not self.buckets:
            super().zero_grad()
        for bucket in (b for buckets in self.buckets.values() for b in buckets):
            bucket.buffer.zero_()
            for param, view in zip(bucket.params, bucket.views):
                param.grad = view

    def stage_done(self, stage: int) -> None:
        """Launch the data-parallel average of one stage's gradients (the stage's backward is complete)."""
        if self.dp_comm.size > 1:
            for bucket in self.buckets[stage]:
                bucket.buffer.div_(self.dp_comm.size)
                self.pending.append(bucket.comm.all_reduce(bucket.buffer, async_op=True))

    def finish(self) -> None:
        for pending in self.pending:
            pending.wait()
        self.pending = []
        if self.copies:
            add_mirror_copies(self.pp_comm, [b.buffer for s in sorted(self.buckets) for b in self.buckets[s]])

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm([p for s, st in self.stages.items() if s not in self.copies
                                 for p in st.parameters()], self.comms)

    def placements(self) -> list:
        """Every stage's parameters whole (stages name them as the plain model does)."""
        return [(p, tensor_pieces(name, p, self.comms)) for st in self.stages.values()
                for name, p in st.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages (path-0 copies), tensor-parallel shards gathered."""
        return {name: gather_full(p, self.comms).cpu().clone() for s, st in self.stages.items()
                if s not in self.copies for name, p in st.named_parameters()}


class PipelineSchedule:
    """Forward and backward of one step as ``schedule`` says, over this rank's ``stages``: the microbatch
    loop of a pipelined layout. Each microbatch's mean loss is scaled by ``loss_scale`` (1/M: the accumulated
    gradient is the batch mean's); the returned loss is the global mean over microbatches. ``hooks`` go to
    the :class:`Executor` (the gradient sync's ``stage_done``; PipeDream's forward and update), and
    ``before_step`` runs first (PipeDream opens a new window of weight versions). Context parallelism: the
    step runs on this rank's sequence ``positions`` (every stage rotates by them; messages hold them only)."""

    def __init__(self, schedule: Schedule, stages: dict[int, nn.Module], comms: Comms, hidden_dim: int,
                 bounds: list[int], store: WeightGradStore, loss_scale: float | None = None,
                 before_step=None, positions: torch.Tensor | None = None, **hooks):
        self.schedule, self.stages, self.comms, self.bounds = schedule, stages, comms, bounds
        self.pp_comm, self.hidden_dim = comms["pp"], hidden_dim
        self.loss_scale = 1.0 / schedule.microbatches if loss_scale is None else loss_scale
        self.positions = positions
        if positions is not None:
            forward = hooks.pop("forward_fn", None) or (lambda a, module, x, y, **kwargs: module(x, y, **kwargs))
            hooks["forward_fn"] = functools.partial(forward, positions=positions)
        self.executor = Executor(schedule, self.pp_comm.rank, stages, self.pp_comm, comms.timeline, store,
                                 **hooks)
        self.before_step = before_step or (lambda: None)
        self.step_records: list[tuple] = []

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, grad_sync=None) -> torch.Tensor:
        self.before_step()
        if self.positions is not None:
            inputs, targets = inputs[:, self.positions], targets[:, self.positions]
        m = self.schedule.microbatches
        micro = microbatches(inputs, targets, m)
        ledger = self.comms.ledger
        with ledger.in_phase("pipeline"):
            losses = self.executor.run([x for x, _ in micro], [y for _, y in micro], self.hidden_dim,
                                       self.loss_scale)
        self.step_records.append((self.executor.records, self.executor.peak_held))
        local = (torch.stack(losses).sum().reshape(1) / m if losses
                 else torch.zeros(1, dtype=torch.promote_types(self.executor.dtype, torch.float32)))
        with ledger.in_phase("report"):
            return self.pp_comm.all_reduce(local).reshape(())

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Validation, forward only: this rank's rows through the stages in order (the first path's placement),
        hidden states sent to the next stage's rank and waited for, so no schedule is needed. Returns the mean
        loss (the last stage's, plus the other stages' load-balancing terms), summed over pp."""
        if self.positions is not None:
            inputs, targets = inputs[:, self.positions], targets[:, self.positions]
        kwargs = {} if self.positions is None else {"positions": self.positions}
        owner, rank, comm = self.schedule.placement[0], self.pp_comm.rank, self.pp_comm
        shape = (inputs.shape[0], inputs.shape[1] // self.executor.seq_shards, self.hidden_dim)
        x, total = inputs, torch.zeros(1, dtype=torch.promote_types(self.executor.dtype, torch.float32))
        for stage in (s for s, holder in enumerate(owner) if holder == rank):
            if stage > 0 and owner[stage - 1] != rank:
                x = torch.empty(shape, dtype=self.executor.dtype)
                comm.send_recv(recvs=[(x, owner[stage - 1])]).wait()
            module = self.stages[stage]
            out = module(x, targets if module.output is not None else None, **kwargs)
            term = out if module.output is not None else module.aux_loss_term()
            total += 0 if term is None else upcast(term)
            if module.output is None and owner[stage + 1] != rank:
                comm.send_recv(sends=[(out.to(self.executor.dtype).contiguous(), owner[stage + 1])]).wait()
            x = out
        return comm.all_reduce(total).reshape(())

    # -- reporting -------------------------------------------------------------------------------------
    def report(self) -> dict:
        """Measured bubble (Zero Bubble definition) and per-action times, against the simulator fed with
        those times; every rank must call it."""
        steps = self.step_records[1:] or self.step_records
        mine = []
        for records, peak in steps:
            compute = [r for r in records if r[0] in "FBIW"]
            mine.append({"span": compute[-1][4] - compute[0][3], "busy": sum(r[4] - r[3] for r in compute),
                         "times": [(r[0], r[4] - r[3]) for r in compute], "peak_held": peak})
        with self.comms.ledger.in_phase("report"):
            t_comm = self._message_seconds()
            ranks = self.pp_comm.all_gather_object((mine, t_comm))
        bubble = pipeline_bubble(self.schedule, [r for r, _ in ranks], max(t for _, t in ranks))
        return {"pipeline": {**bubble, "stage_bounds": self.bounds}}

    def _message_seconds(self, repeats: int = 7) -> float:
        """One-way time of one activation message: median of ring exchanges over the pipeline ranks."""
        comm, rank = self.pp_comm, self.pp_comm.rank
        out, back = torch.zeros(self.executor.shape), torch.empty(self.executor.shape)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            comm.send_recv(sends=[(out, (rank + 1) % comm.size)], recvs=[(back, (rank - 1) % comm.size)]).wait()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)


def cut_stages(model: nn.Module, parallel: ParallelConfig, cfg: TrainConfig, comms: Comms, schedule: Schedule,
               bounds: list[int] | None = None) -> tuple[dict[int, nn.Module], set[int], list[int]]:
    """This rank's stages of ``model`` (stage index -> module), DualPipe's second copies among them, and the
    layer bounds: ``bounds`` if given, else equal layer counts, or for ``pp_balance="measured"`` the
    per-layer times rank 0 measures."""
    if bounds is None:
        bounds = (measured_bounds(model.cfg, parallel, cfg, comms) if parallel.pp_balance == "measured"
                  else equal_bounds(model.cfg.n_layers, schedule.num_stages))
    wanted = schedule.modules_on(comms["pp"].rank)
    stages = build_stages(model, bounds, wanted)
    copies = {s for path, s in wanted if path == 1}
    for s, stage in stages.items():
        if s not in copies:
            for p in stage.parameters():
                mark_sharded(p, "pp", tensor_dim=None)  # the global norm sums stages over pp
    return stages, copies, bounds


def pipeline_bubble(schedule: Schedule, ranks: list[list[dict]], t_comm: float = 0.0) -> dict:
    """Median over steps of the measured bubble rate (longest span minus mean busy time, over the longest
    span) and the simulator's bubble rate for the measured mean per-action times, with t_comm = 0 and with
    the measured one-way message time ``t_comm``; the peak activations held per rank, measured and
    simulated."""
    rates = []
    for step in zip(*ranks):
        cost = max(r["span"] for r in step)
        rates.append((cost - statistics.fmean(r["busy"] for r in step)) / cost)
    by_kind: dict[str, list[int]] = {}
    for rank in ranks:
        for step in rank:
            for kind, ns in step["times"]:
                by_kind.setdefault(kind, []).append(ns)
    mean = {k: statistics.fmean(v) / 1e9 * schedule.chunks for k, v in by_kind.items()}  # one stage's share
    if "I" in mean:
        times = Times(mean["F"], mean["I"], mean.get("W", 0.0))
    else:
        times = Times(mean["F"], mean["B"], 0.0)
    sim = simulate(schedule, times)
    with_comm = simulate(schedule, Times(times.t_f, times.t_b, times.t_w, t_comm))
    return {"schedule": schedule.name, "pp": schedule.pp, "microbatches": schedule.microbatches,
            "measured_bubble_rate": statistics.median(rates), "simulated_bubble_rate": sim.bubble_rate,
            "simulated_bubble_rate_with_comm": with_comm.bubble_rate,
            "t_f_s": times.t_f, "t_b_s": times.t_b, "t_w_s": times.t_w, "t_comm_s": t_comm,
            # activations held, in (stage, microbatch) units: measured by the executor, and the simulator's
            "peak_held_per_rank": [max(step["peak_held"] for step in rank) for rank in ranks],
            "simulated_peak_per_rank": [round(p * schedule.chunks) for p in sim.peak_activations]}
