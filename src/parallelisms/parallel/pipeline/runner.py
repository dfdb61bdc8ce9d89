"""The pipeline-parallel parts of a training step: the stages cut from the plain model and the schedule as the
step's forward and backward (:class:`PipelineSchedule`). The gradient sync over data parallelism and between
DualPipe's two copies is the layout's own engine per stage (:mod:`.stage_sync`); clip and step are the common
ones, or, for a schedule that updates after every microbatch (PipeDream), its update hook.

Layout: ``comms["pp"]`` carries activations and gradients between stages, ``comms["dp"]`` each stage's
data-parallel reduction, launched asynchronously right after that stage's last weight-gradient work of the step
(the executor's ``on_stage_done``), so it overlaps the rest of the schedule, and waited before the optimizer.
DualPipe (DeepSeek-V3 report) keeps stage ``s`` on ranks ``s`` (path 0) and ``pp-1-s`` (path 1); the two copies
exchange gradients and both add, so they stay identical.

With tensor parallelism (Megatron-LM's PP x TP) the model is made tensor-parallel over ``comms["tp"]``
before it is cut, so every stage holds tensor-parallel modules; ``comms["pp"]`` joins the ranks of one tp
coordinate, so each TP rank exchanges its own copy of the activations with its peer in the next stage, or,
under sequence parallelism, its sequence shard (1/tp of the bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import statistics
import time

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.config import ParallelConfig, TrainConfig
from parallelisms.data.loader import microbatches
from parallelisms.model.numerics import upcast
from parallelisms.parallel.common import mark_sharded
from parallelisms.parallel.pipeline.executor import Executor, WeightGradStore
from parallelisms.parallel.pipeline.partition import balanced_bounds, equal_bounds, profile_costs
from parallelisms.parallel.pipeline.pipedream import WeightStashing
from parallelisms.parallel.pipeline.schedules import Action, Kind, Schedule, produces, requires, schedule_for
from parallelisms.parallel.pipeline.simulate import Times, simulate
from parallelisms.parallel.pipeline.stage import build_stages
from parallelisms.parallel.pipeline.stage_sync import StageSyncs
from parallelisms.options import PpBalance


def measured_bounds(model_cfg, parallel: ParallelConfig, cfg: TrainConfig, comms: Comms,
                    costs: tuple | None = None) -> list[int]:
    """Stage bounds minimising the slowest stage's measured forward + backward time. Rank 0 profiles one
    microbatch per part and every rank takes its figures, so all ranks cut the model the same way. ``costs``:
    the parts' costs to cut by in place of the profile (the dry run's, which need no tensors), gathered from
    rank 0 all the same."""
    schedule = schedule_for(parallel)
    rows = cfg.global_batch // parallel.dims.dp // schedule.microbatches
    if costs is None and comms["world"].rank == 0:
        costs = profile_costs(model_cfg, rows, cfg.seq_len)
    with comms.ledger.in_phase("setup"):
        costs = comms["world"].all_gather_object(costs)[0]
    return balanced_bounds(*costs, schedule.num_stages)


class PipelineSchedule:
    """Forward and backward of one step as ``schedule`` says, over this rank's ``stages``: the microbatch
    loop of a pipelined layout. Each microbatch's mean loss is scaled by 1/M (the accumulated gradient is the
    batch mean's); the returned loss is the global mean over microbatches. The executor calls ``grad_sync``'s
    ``stage_done`` (a :class:`StageSyncs`, possibly wrapped) after a stage's last backward work before an update.
    A schedule that updates after every microbatch (PipeDream) gets its hooks from :class:`WeightStashing`
    (``updates``: the forward on stashed weights, the update once the stage's engine has averaged the gradient,
    a new window of versions before each step) and scales each microbatch's loss by 1. Context parallelism:
    the step runs on this rank's sequence ``positions`` (every stage rotates by them; messages hold them only)."""

    def __init__(self, schedule: Schedule, stages: dict[int, nn.Module], comms: Comms, hidden_dim: int,
                 bounds: list[int], store: WeightGradStore, grad_sync: StageSyncs, train: TrainConfig,
                 positions: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        self.schedule, self.stages, self.comms, self.bounds = schedule, stages, comms, bounds
        self.pp_comm, self.hidden_dim = comms["pp"], hidden_dim
        self.loss_scale = 1.0 / schedule.microbatches
        self.positions = positions
        hooks = {"on_stage_done": grad_sync.stage_done, "dtype": dtype}
        self.updates = None  # the schedule's own updates (PipeDream)
        if schedule.updates_per_microbatch:
            self.updates = WeightStashing(stages, grad_sync, train, comms, compute_dtype=dtype)
            hooks.update(forward_fn=self.updates.forward, on_optimizer=self.updates.update)
            self.loss_scale = 1.0  # each update takes one microbatch's mean-loss gradient
        if positions is not None:
            forward = hooks.pop("forward_fn", None) or (lambda a, module, x, y, **kwargs: module(x, y, **kwargs))
            hooks["forward_fn"] = functools.partial(forward, positions=positions)
        self.executor = Executor(schedule, self.pp_comm.rank, stages, self.pp_comm, comms.timeline, store,
                                 **hooks)
        self.before_step = self.updates.start_window if self.updates else (lambda: None)
        self.step_records: list[tuple] = []
        self.weight = 1.0    # the factor on this rank's loss (--dp-balance measured: its replica's share)
        self.compute_ns = 0  # the last step's time, waits left out (--dp-balance measured)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, grad_sync=None) -> torch.Tensor:
        self.before_step()
        if self.positions is not None:
            inputs, targets = inputs[:, self.positions], targets[:, self.positions]
        m = self.schedule.microbatches
        micro = microbatches(inputs, targets, m)
        ledger = self.comms.ledger
        start, waited = time.perf_counter_ns(), ledger.waited_ns
        with ledger.in_phase("pipeline"):
            losses = self.executor.run([x for x, _ in micro], [y for _, y in micro], self.hidden_dim,
                                       self.loss_scale * self.weight)
        self.compute_ns = time.perf_counter_ns() - start - (ledger.waited_ns - waited)
        self.step_records.append((self.executor.records, self.executor.peak_held))
        local = (torch.stack(losses).sum().reshape(1) * self.weight / m if losses
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
                         "records": compute, "peak_held": peak})
        with self.comms.ledger.in_phase("report"):
            t_comm = self._message_seconds()
            ranks = self.pp_comm.all_gather_object((mine, t_comm, socket.gethostname()))
        one_clock = len({host for _, _, host in ranks}) == 1  # perf_counter is one clock within a host
        bubble = pipeline_bubble(self.schedule, [r for r, _, _ in ranks], max(t for _, t, _ in ranks), one_clock)
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
               bounds: list[int] | None = None, costs: tuple | None = None
               ) -> tuple[dict[int, nn.Module], set[int], list[int]]:
    """This rank's stages of ``model`` (stage index -> module), DualPipe's second copies among them, and the
    layer bounds: ``bounds`` if given, else equal layer counts, or for ``pp_balance="measured"`` the
    per-layer times rank 0 measures (or ``costs``: :func:`measured_bounds`)."""
    if bounds is None:
        bounds = (measured_bounds(model.cfg, parallel, cfg, comms, costs) if parallel.pp_balance is PpBalance.MEASURED
                  else equal_bounds(model.cfg.n_layers, schedule.num_stages))
    wanted = schedule.modules_on(comms["pp"].rank)
    stages = build_stages(model, bounds, wanted)
    copies = {s for path, s in wanted if path == 1}
    release_other_stages(model, [stage for s, stage in stages.items() if s not in copies])
    for s, stage in stages.items():
        if s not in copies:
            for p in stage.parameters():
                mark_sharded(p, "pp", tensor_dim=None)  # the global norm sums stages over pp
    return stages, copies, bounds


def release_other_stages(model: nn.Module, held: list[nn.Module]) -> None:
    """Drop from the full ``model`` the blocks, embedding and head that none of this rank's ``held`` stages
    shares (DualPipe's copies own theirs): the rank never runs them, so it does not keep their memory (as
    torchtitan's pipeline split deletes the other stages' modules)."""
    kept = {key for stage in held for key in stage.layers}
    for key in [key for key in model.layers if key not in kept]:
        del model.layers[key]
    for end in ("tok_embeddings", "norm", "output"):
        if all(getattr(stage, end) is None for stage in held):
            setattr(model, end, None)


def pipeline_bubble(schedule: Schedule, ranks: list[list[dict]], t_comm: float = 0.0, one_clock: bool = False) -> dict:
    """Median over steps of the measured bubble rate (longest span minus mean busy time, over the longest
    span) and the simulator's, fed with the measured mean time of each action kind on each stage (the first
    stage holds the embedding, the last the head and loss): with nothing between actions, with the one-way
    message time ``t_comm`` (ring exchanges after training), and, where every rank reads one clock
    (``one_clock``), with the run's own dependency latency and host time between actions (see
    :func:`run_latencies`); the peak activations held per rank, measured and simulated."""
    rates = []
    for step in zip(*ranks):
        cost = max(r["span"] for r in step)
        rates.append((cost - statistics.fmean(r["busy"] for r in step)) / cost)
    by_kind: dict[tuple[str, int], list[int]] = {}
    for rank in ranks:
        for step in rank:
            for kind, stage, _, start, end in step["records"]:
                by_kind.setdefault((kind, stage), []).append(end - start)

    def mean(kind: str, stages=range(schedule.num_stages)) -> float:
        samples = [ns for s in stages for ns in by_kind.get((kind, s), [])]
        return statistics.fmean(samples) / 1e9 if samples else 0.0
    backward = "I" if any(kind == "I" for kind, _ in by_kind) else "B"
    per_stage = tuple((mean("F", [s]), mean(backward, [s]), mean("W", [s])) for s in range(schedule.num_stages))
    chunks = schedule.chunks  # one rank's share: a stage's mean times its chunks (no W records: t_w 0)
    times = Times(mean("F") * chunks, mean(backward) * chunks, mean("W") * chunks, 0.0, per_stage)
    sim = simulate(schedule, times)
    with_comm = simulate(schedule, dataclasses.replace(times, t_comm=t_comm))
    latency = host = in_run = None
    if one_clock:
        latency, host = run_latencies(schedule, ranks)
        in_run = simulate(schedule, dataclasses.replace(times, t_comm=latency, t_host=host))
    return {"schedule": schedule.name, "pp": schedule.pp, "microbatches": schedule.microbatches,
            "measured_bubble_rate": statistics.median(rates), "simulated_bubble_rate": sim.bubble_rate,
            "simulated_makespan_s": sim.makespan,  # the same actions with nothing between them
            "simulated_bubble_rate_with_comm": with_comm.bubble_rate,
            "simulated_bubble_rate_in_run": in_run.bubble_rate if in_run else None,
            "t_f_s": times.t_f, "t_b_s": times.t_b, "t_w_s": times.t_w, "t_comm_s": t_comm,
            "t_latency_in_run_s": latency, "t_host_s": host,
            "stage_times_s": [list(t) for t in per_stage],
            # activations held, in (stage, microbatch) units: measured by the executor, and the simulator's
            "peak_held_per_rank": [max(step["peak_held"] for step in rank) for rank in ranks],
            "simulated_peak_per_rank": [round(p * schedule.chunks) for p in sim.peak_activations]}


def run_latencies(schedule: Schedule, ranks: list[list[dict]]) -> tuple[float, float]:
    """(dependency latency, host time between actions) in seconds, medians over the run's steps, from each rank's
    compute records on one clock. An action whose input from another rank was ready before the rank's previous
    action ended started ``host`` after that action (posting sends and receives, bookkeeping); one whose input
    came later started ``latency`` after the producing action ended (the message, its wait and the same
    bookkeeping): what the simulator's ``t_comm`` and ``t_host`` stand for."""
    latencies, hosts = [], []
    for step in zip(*ranks):
        done = {}  # (tag, stage, mb) -> (end, rank)
        for r, rank_step in enumerate(step):
            for kind, stage, mb, start, end in rank_step["records"]:
                for tag in produces(Action(Kind(kind), stage, mb)):
                    done[(tag, stage, mb)] = (end, r)
        for r, rank_step in enumerate(step):
            records = rank_step["records"]
            for before, (kind, stage, mb, start, _) in zip(records, records[1:]):
                inputs = [done[n] for n in requires(Action(Kind(kind), stage, mb), schedule.num_stages)
                          if n in done and done[n][1] != r]
                latest = max((end for end, _ in inputs), default=None)
                if latest is not None and latest > before[4]:
                    latencies.append(start - latest)
                elif start >= before[4]:
                    hosts.append(start - before[4])
    median = (lambda xs: statistics.median(xs) / 1e9 if xs else 0.0)
    return median(latencies), median(hosts)
