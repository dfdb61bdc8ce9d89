"""The pipeline-parallel training step: split the plain model into stages, run the schedule, synchronise
gradients over data parallelism and between DualPipe's two copies, clip by the global norm, step.

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

import statistics
import time

import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.config import ParallelConfig, TrainConfig
from parallelisms.data.loader import microbatches
from parallelisms.parallel.common import gather_full, global_grad_norm, mark_sharded
from parallelisms.parallel.data import Bucket
from parallelisms.parallel.pipeline.executor import Executor, WeightGradStore, split_linears
from parallelisms.parallel.pipeline.partition import balanced_bounds, equal_bounds, profile_costs
from parallelisms.parallel.pipeline.schedules import Schedule, build_schedule
from parallelisms.parallel.pipeline.simulate import Times, simulate
from parallelisms.parallel.pipeline.stage import build_stages
from parallelisms.train import Runner


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


class PipelineRunner(Runner):
    """Runs one schedule per optimizer step; the returned loss is the global mean over microbatches."""

    def __init__(self, model: nn.Module, parallel: ParallelConfig, cfg: TrainConfig, comms: Comms,
                 bounds: list[int] | None = None):
        self.schedule = schedule_for(parallel)
        self.pp_comm, self.dp_comm = comms["pp"], comms["dp"]
        rank = self.pp_comm.rank
        self.bounds = bounds or equal_bounds(model.cfg.n_layers, self.schedule.num_stages)
        wanted = self.schedule.modules_on(rank)
        seq_shards = self._tensor_parallel(model, parallel, comms)
        self.stages = build_stages(model, self.bounds, wanted, seq_shards)
        self.copies = {s for path, s in wanted if path == 1}  # DualPipe's second copies
        self.hidden_dim = model.cfg.dim
        store = WeightGradStore()
        if self.schedule.split_backward:
            for stage in self.stages.values():
                split_linears(stage, store)
        super().__init__(nn.ModuleList(self.stages.values()), comms, cfg, None)
        for s, stage in self.stages.items():
            if s not in self.copies:
                for p in stage.parameters():
                    mark_sharded(p, "pp", tensor_dim=None)  # the global norm sums stages over pp
        self.buckets = self._grad_buffers()
        self.dp_pending: list = []
        self.executor = Executor(self.schedule, rank, self.stages, self.pp_comm, comms.timeline, store,
                                 seq_shards=seq_shards, **self.executor_hooks())
        self.step_records: list[list] = []

    @classmethod
    def for_layout(cls, model: nn.Module, parallel: ParallelConfig, cfg: TrainConfig, comms: Comms) -> "PipelineRunner":
        """The runner of ``parallel.schedule`` (PipeDream's asynchronous updates have their own), with stages cut
        by equal layer counts or, for ``pp_balance="measured"``, by the per-layer times rank 0 measures."""
        bounds = None
        if parallel.pp_balance == "measured":
            bounds = measured_bounds(model.cfg, parallel, cfg, comms)
        if parallel.schedule == "pipedream":
            from parallelisms.parallel.pipeline.pipedream import PipeDreamRunner
            return PipeDreamRunner(model, parallel, cfg, comms, bounds=bounds)
        if parallel.zero:
            from parallelisms.parallel.pipeline.zero import ZeroPipelineRunner
            return ZeroPipelineRunner(model, parallel, cfg, comms, bounds=bounds)
        return cls(model, parallel, cfg, comms, bounds=bounds)

    @staticmethod
    def _tensor_parallel(model: nn.Module, parallel: ParallelConfig, comms: Comms) -> int:
        """Make ``model`` tensor-parallel (before the cut, so stages take the parallel modules); returns the
        number of sequence shards of the hidden states stages exchange (tp under SP, else 1)."""
        if parallel.dims.tp == 1:
            return 1
        from parallelisms.parallel.tensor import apply_tensor_parallel
        apply_tensor_parallel(model, comms["tp"], sequence_parallel=parallel.sequence_parallel,
                              overlap=parallel.tp_overlap)
        return parallel.dims.tp if parallel.sequence_parallel else 1

    def executor_hooks(self) -> dict:
        return {"on_stage_done": self._sync_stage}

    def loss_scale(self) -> float:
        """Each microbatch's mean loss is scaled by 1/M: the accumulated gradient is the batch mean's."""
        return 1.0 / self.schedule.microbatches

    # -- gradients -------------------------------------------------------------------------------------
    def _grad_buffers(self) -> dict[int, Bucket]:
        """Flat per-stage gradient buffers, for one all-reduce per stage and the DualPipe exchange; without
        either, none: gradients are plain (set to None between steps, so the first microbatch's is not an add)."""
        if self.dp_comm.size == 1 and not self.copies:
            return {}
        return {s: Bucket(list(st.parameters()), [n for n, _ in st.named_parameters()], self.dp_comm)
                for s, st in self.stages.items()}

    def zero_grad(self) -> None:
        if not self.buckets:
            for p in self.params:
                p.grad = None
        for bucket in self.buckets.values():
            bucket.buffer.zero_()
            for param, view in zip(bucket.params, bucket.views):
                param.grad = view

    def _sync_stage(self, stage: int) -> None:
        """Launch the data-parallel average of one stage's gradients (the stage's backward is complete)."""
        if self.dp_comm.size > 1:
            buffer = self.buckets[stage].buffer.div_(self.dp_comm.size)
            self.dp_pending.append(self.dp_comm.all_reduce(buffer, async_op=True))

    def _sum_dualpipe_copies(self) -> None:
        """Rank r and rank pp-1-r hold the same two stages; each adds the other's gradient buffers."""
        if not self.copies:
            return
        peer = self.schedule.pp - 1 - self.pp_comm.rank
        mine = sorted(self.buckets)
        theirs = [torch.empty_like(self.buckets[s].buffer) for s in mine]
        self.pp_comm.send_recv(sends=[(self.buckets[s].buffer, peer) for s in mine],
                               recvs=list(zip(theirs, [peer] * len(mine)))).wait()
        for s, other in zip(mine, theirs):  # the peer holds the same two stages, sent in the same order
            self.buckets[s].buffer.add_(other)

    # -- one step --------------------------------------------------------------------------------------
    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        m = self.schedule.microbatches
        micro = microbatches(inputs, targets, m)
        ledger = self.comms.ledger
        with ledger.in_phase("pipeline"):
            losses = self.executor.run([x for x, _ in micro], [y for _, y in micro], self.hidden_dim,
                                       self.loss_scale())
        with ledger.in_phase("backward"):
            for pending in self.dp_pending:
                pending.wait()
            self.dp_pending = []
            self._sum_dualpipe_copies()
        self.step_records.append((self.executor.records, self.executor.peak_held))
        local = (torch.stack(losses).sum().reshape(1) / m if losses
                 else torch.zeros(1, dtype=torch.promote_types(self.executor.dtype, torch.float32)))
        with ledger.in_phase("report"):
            return self.pp_comm.all_reduce(local).reshape(())

    def global_grad_norm(self) -> torch.Tensor:
        """Summed over the pipeline's stages; DualPipe's second copies are left out of the norm (the clip
        still scales them)."""
        return global_grad_norm([p for s, st in self.stages.items() if s not in self.copies
                                 for p in st.parameters()], self.comms)

    # -- reporting -------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model by plain names: tensor-parallel shards gathered over tp, then every pipeline
        rank's stages (path-0 copies)."""
        with self.comms.ledger.in_phase("report"):
            mine = {name: gather_full(p, self.comms).cpu().clone() for s, st in self.stages.items()
                    if s not in self.copies for name, p in st.named_parameters()}
            parts = self.pp_comm.all_gather_object(mine)
        return {name: t for part in parts for name, t in part.items()}

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
