"""The training loop, run on every rank: build the full seeded model, parallelize it, train, report.

A :class:`Runner` owns the local model, its optimizer and the gradient synchronisation of one layout and
does one optimizer step per ``train_step``. :func:`parallelize` picks the runner for a layout; each
parallelism adds its branch there. :func:`train_rank` is the per-rank entry point for ``launch``.
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from parallelisms.comm import CommLedger, Comms, Timeline
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.data.loader import microbatches
from parallelisms.launch import RankInfo
from parallelisms.model import build_model
from parallelisms.model.numerics import upcast
from parallelisms.parallel.common import clip_grad_norm_, gather_full, global_grad_norm
from parallelisms.parallel.data import DataParallel


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs (picklable, sent to every process)."""

    model: ModelConfig
    train: TrainConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    progress: bool = False        # tqdm bar on rank 0
    collect_state: bool = False   # return the full final parameters (verify)


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=1e-8)


class Runner:
    """One layout's training step. Subclasses override what differs; the dense data-parallel step is here."""

    def __init__(self, model: nn.Module, comms: Comms, cfg: TrainConfig, grad_sync: DataParallel | None,
                 positions: torch.Tensor | None = None):
        self.model, self.comms, self.cfg, self.grad_sync = model, comms, cfg, grad_sync
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, cfg)
        self.positions = positions  # context parallelism: the sequence positions this rank holds
        self.grad_norm: torch.Tensor | None = None  # the last step's global gradient norm, before clipping

    def zero_grad(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.zero_grad()
        else:
            self.model.zero_grad(set_to_none=True)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Accumulated gradients of the mean loss over this rank's rows; returns the local mean loss."""
        ledger, timeline = self.comms.ledger, self.comms.timeline
        micro = microbatches(inputs, targets, self.cfg.grad_accum)
        total = None
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with (self.grad_sync.no_sync() if self.grad_sync is not None and not last else nullcontext()):
                with ledger.in_phase("forward"), timeline.span("forward"):
                    if self.positions is None:
                        loss = self.model(x, y) / len(micro)
                    else:
                        pos = self.positions.to(x.device)
                        loss = self.model(x[:, pos], y[:, pos], positions=pos) / len(micro)
                with ledger.in_phase("backward"), timeline.span("backward"):
                    loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return upcast(total).cpu()

    def global_grad_norm(self) -> torch.Tensor:
        """The L2 norm of the whole model's gradient (every rank gets it): squared norms of the local pieces
        summed over the mesh dimensions each is sharded on."""
        return global_grad_norm(self.params, self.comms)

    def optimizer_step(self) -> None:
        """Measure the global gradient norm (reported every step, clipping or not), clip by it when asked,
        step the optimizer, then :meth:`after_step`."""
        with self.comms.ledger.in_phase("optimizer"), self.comms.timeline.span("optimizer"):
            self.grad_norm = self.global_grad_norm()
            if self.cfg.grad_clip > 0:
                clip_grad_norm_(self.params, self.cfg.grad_clip, self.comms, norm=self.grad_norm)
            self.optimizer.step()
            self.after_step()

    def after_step(self) -> None:
        """What follows the optimizer step (the sharded engines refresh full parameters from their shards)."""

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.zero_grad()
        loss = self.forward_backward(inputs, targets)
        self.optimizer_step()
        return loss

    def memory_report(self) -> dict:
        """Persistent bytes of parameters, gradients and optimizer state on this rank, and peaks."""
        from parallelisms.parallel.memory import memory_report, tensor_bytes
        return memory_report(tensor_bytes(self.params), tensor_bytes(p.grad for p in self.params), self.optimizer)

    def report(self) -> dict:
        """Layout-specific figures merged into rank 0's report (e.g. the pipeline bubble); every rank calls it."""
        return {}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) parameters by the plain model's names; every rank must call it."""
        with self.comms.ledger.in_phase("report"):
            return {name: gather_full(p, self.comms).cpu().clone() for name, p in self.model.named_parameters()}


def parallelize(model: nn.Module, parallel: ParallelConfig, train: TrainConfig, comms: Comms) -> Runner:
    """Apply the layout to the full model, in a fixed order (pipeline split, TP/SP, CP, EP, ZeRO/FSDP/DDP).

    Each parallelism's branch lives in its own module; this function only decides the order.
    """
    if parallel.dims.pp > 1:
        from parallelisms.parallel.pipeline.runner import PipelineRunner
        return PipelineRunner.for_layout(model, parallel, train, comms)
    if parallel.dims.tp > 1:
        from parallelisms.parallel.tensor import apply_tensor_parallel
        apply_tensor_parallel(model, comms["tp"], sequence_parallel=parallel.sequence_parallel,
                              overlap=parallel.tp_overlap)
    if parallel.fsdp and parallel.fsdp_style != "flat":
        from parallelisms.parallel.fsdp2 import per_param_runner
        return per_param_runner(model, parallel, train, comms)
    positions = None
    if parallel.dims.cp > 1:
        from parallelisms.parallel.context import apply_context_parallel
        positions = apply_context_parallel(model, comms["cp"], parallel.cp_attention, train.seq_len)
    replica_comms = None
    if parallel.dims.ep > 1:
        from parallelisms.parallel.expert import apply_expert_parallel
        apply_expert_parallel(model, comms["ep"])
        replica_comms = {"ep": comms["ep_replicate"]}
    if parallel.recompute != "none":
        from parallelisms.parallel.recompute import apply_recompute
        apply_recompute(model, parallel.recompute)
    if parallel.zero or parallel.fsdp:
        from parallelisms.parallel.zero import parallelize_sharded
        return parallelize_sharded(model, parallel, train, comms, positions)
    grad_sync = None
    if parallel.dims.dp * parallel.dims.cp > 1:  # context-parallel ranks hold different tokens: average over both
        grad_sync = DataParallel(model, comms["dp_cp"], bucket_cap_mb=train.bucket_mb,
                                 find_unused_parameters=parallel.find_unused_parameters, replica_comms=replica_comms)
    return Runner(model, comms, train, grad_sync, positions)


def train_rank(info: RankInfo, spec: RunSpec, trace: bool = False) -> dict | None:
    """Train on this rank; rank 0 returns the report (losses, timings, communication, spans of every rank)."""
    dims = spec.parallel.dims.check_world_size(info.world_size)
    torch.manual_seed(spec.train.seed)
    meshes = dims.build_meshes(info.device.type) if info.world_size > 1 else {}
    comms = Comms(meshes, CommLedger(), Timeline(info.rank, enabled=trace))
    model = build_model(spec.model, spec.train.seed, info.device, spec.train.torch_dtype)
    runner = parallelize(model, spec.parallel, spec.train, comms)
    coords = dims.coordinates(info.rank)
    dp_rank = coords["dp_replicate"] * dims.dp_shard + coords["dp_shard"]
    loader = BatchLoader(load_corpus(), spec.train.global_batch, spec.train.seq_len, spec.train.seed)

    steps = range(spec.train.steps)
    if spec.progress and info.rank == 0:
        from tqdm import tqdm
        steps = tqdm(steps, desc=f"train {dims.describe()}", unit="step", dynamic_ncols=True)
    tokens_per_step = spec.train.global_batch * spec.train.seq_len
    losses, grad_norms, step_times, step_windows, ledger_marks = [], [], [], [], []
    for step in steps:
        inputs, targets = (t.to(info.device) for t in loader.shard(step, dp_rank, dims.dp))
        ledger_marks.append(comms.ledger.mark())
        start = Timeline.now()
        loss = runner.train_step(inputs, targets)
        end = Timeline.now()
        losses.append(loss)
        grad_norms.append(None if runner.grad_norm is None else runner.grad_norm.item())
        step_times.append((end - start) / 1e9)
        step_windows.append((start, end))
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_per_step / step_times[-1]:,.0f}")

    # Reporting: one all-reduce of every step's loss over the data-parallel ranks, outside the timed steps.
    with comms.ledger.in_phase("report"):
        losses = comms["dp_cp"].all_reduce(torch.stack(losses)) / (dims.dp * dims.cp)
        measured = slice(1, None) if len(step_windows) > 1 else slice(None)  # the first step warms up
        # training only: one-off setup (DDP's bucket rebuild after the first step) and reporting left out
        step_comm = comms.ledger.summary(since=ledger_marks[measured][0], per=len(ledger_marks[measured]),
                                         exclude_phases=("report", "setup"))
        overlap = [comms.timeline.overlap_stats(s, e) for s, e in step_windows[measured]] if trace else []
        gathered = _gather_objects(comms, {"overlap": overlap, "spans": comms.timeline.spans if trace else [],
                                           "memory": runner.memory_report()}, info.world_size)
    state = runner.full_state_dict() if spec.collect_state else None
    extra = runner.report()
    if info.rank != 0:
        return None
    median = statistics.median(step_times[measured])
    report = {
        "world_size": info.world_size, "layout": dims.describe(), "steps": spec.train.steps,
        "loss_first": losses[0].item(), "loss_last": losses[-1].item(), "losses": losses.tolist(),
        "grad_norms": None if None in grad_norms else grad_norms,
        "step_time_s": median, "tokens_per_s": tokens_per_step / median, "comm": step_comm,
        "memory": gathered[0]["memory"], "memory_per_rank": [g["memory"] for g in gathered],
    }
    report.update(extra)
    if trace:
        per_rank = [_sum_stats(g["overlap"]) for g in gathered]
        report["overlap_per_rank"] = per_rank
        report["exposed_comm_fraction"] = max(s["exposed_ns"] / max(s["wall_ns"], 1) for s in per_rank)
        report["spans"] = [g["spans"] for g in gathered]
    if state is not None:
        report["state"] = state
    return report


def _sum_stats(stats: list[dict]) -> dict:
    keys = ("comm_ns", "busy_ns", "exposed_ns", "wall_ns")
    return {k: sum(s[k] for s in stats) for k in keys}


def _gather_objects(comms: Comms, obj, world_size: int) -> list:
    """Every rank's ``obj`` on every rank (for the report only)."""
    return comms["world"].all_gather_object(obj) if world_size > 1 else [obj]
