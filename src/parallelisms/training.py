"""The training loop, run on every rank: build the full seeded model, parallelize it, train, report.

:func:`parallelisms.train_setup.parallelize` applies the layout and returns the
:class:`parallelisms.trainer.Trainer` that does the same step for every layout; this module runs the steps
(data, evaluation, checkpoints, metrics, stragglers) and assembles rank 0's report. :func:`train_rank` is the
per-rank entry point for ``launch``, :func:`run_layout` launches it.
"""

from __future__ import annotations

import statistics
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from parallelisms.comm import CommLedger, Comms, Timeline
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.data import BatchLoader
from parallelisms.data.sources import train_and_eval_tokens
from parallelisms.launch import RankInfo, launch, under_torchrun
from parallelisms.model import build_model
from parallelisms.metrics import MetricsWriter
from parallelisms.parallel.dp_balance import DataBalance
from parallelisms.parallel.expert_load import ExpertLoad
from parallelisms.step_log import LossLog
from parallelisms.resume import CheckpointOptions
from parallelisms.stragglers import StragglerWatch
from parallelisms.train_setup import parallelize
from parallelisms.trainer import Trainer
from parallelisms.options import Balance, NonFinite


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs (picklable, sent to every process)."""

    model: ModelConfig
    train: TrainConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    progress: bool = False        # tqdm bar on rank 0
    collect_state: bool = False   # return the full final parameters (verify)
    checkpoint: CheckpointOptions | None = None  # --save / --resume (parallelisms.checkpoint)
    metrics_path: str | None = None      # JSON lines per step, rank 0 (parallelisms.metrics)
    tensorboard_dir: str | None = None   # TensorBoard scalars, rank 0
    init_from: str | None = None         # a Hugging Face Llama directory: the initial weights (parallelisms.hf)
    poison_fresh_memory: bool = False    # verify: fresh memory (torch.empty, buffers) filled with NaN (_poisoned)
    keep_spans: bool = True              # the report carries every span (--trace, --predict); else summed per step
    straggler_report: bool = True        # False: no arrival notes nor report (its cost's A/B, bench straggler-cost)


@contextmanager
def _poisoned(on: bool):
    """While entered (``on``), memory torch hands out uninitialised (``torch.empty``, ``new_empty``, a resized
    storage: the engines' flat buffers, buckets, shards and receive buffers) is filled with NaN, so a read of it
    before it is written makes verify fail loudly rather than by luck: torch's deterministic mode's
    ``fill_uninitialized_memory`` (silent, not raising, on the operators it has no deterministic version of).
    The previous settings are restored afterwards (a single-process run trains in the caller's process)."""
    if not on:
        yield
        return
    import warnings

    import torch.utils.deterministic as deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():  # only the NaN fill is wanted, not the mode's notes on other operators
            warnings.filterwarnings("ignore", message=".*(does not have a deterministic implementation|"
                                                      "CUBLAS_WORKSPACE_CONFIG)")
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        deterministic.fill_uninitialized_memory = before[2]


def train_rank(info: RankInfo, spec: RunSpec, trace: bool = False) -> dict | None:
    """Train on this rank; rank 0 returns the report (losses, timings, communication, spans of every rank)."""
    with _poisoned(spec.poison_fresh_memory):
        return _train_rank(info, spec, trace)


def _train_rank(info: RankInfo, spec: RunSpec, trace: bool = False) -> dict | None:
    dims = spec.parallel.dims.check_world_size(info.world_size)
    torch.manual_seed(spec.train.seed)
    meshes = dims.build_meshes(info.device.type) if info.world_size > 1 else {}
    slow = spec.train.slow_rank
    comms = Comms(meshes, CommLedger(keep=spec.keep_spans), Timeline(info.rank, enabled=trace, keep=spec.keep_spans,
                                                 slow=slow[1] if slow and slow[0] == info.rank else 1.0))
    if info.heartbeat is not None:  # a peer that times out waiting for this rank can then say where it is
        info.heartbeat.follow(comms.ledger)
    model = build_model(spec.model, spec.train.seed, info.device, spec.train.torch_dtype)
    if spec.init_from:
        from parallelisms.hf import load_hf
        model.load_state_dict(load_hf(spec.init_from, spec.train.torch_dtype)[1])
    trainer = parallelize(model, spec.parallel, spec.train, comms)
    watch = StragglerWatch(comms, info.rank, info.world_size, trace and spec.keep_spans,  # each wait: --trace only
                           enabled=spec.straggler_report)
    experts = ExpertLoad(model, dims.ep) if spec.model.n_experts else None
    coords = dims.coordinates(info.rank)
    dp_rank = coords["dp_replicate"] * dims.dp_shard + coords["dp_shard"]
    train_tokens, eval_tokens = train_and_eval_tokens(spec.train.data)
    loader = BatchLoader(train_tokens, spec.train.global_batch, spec.train.seq_len, spec.train.seed,
                         spec.train.data.vocab_sweep)
    unit = trainer.forward_backward.schedule.microbatches if dims.pp > 1 else spec.train.grad_accum  # rows split whole
    balance = (DataBalance(comms, dims.dp, dp_rank, spec.train.global_batch, unit, spec.parallel.rebalance_every)
               if spec.parallel.dp_balance is Balance.MEASURED else None)
    data = spec.train.data
    evaluation = None
    if eval_tokens is not None:  # fixed held-out batches, the same at every evaluation
        held = BatchLoader(eval_tokens, spec.train.global_batch, spec.train.seq_len, spec.train.seed)
        evaluation = [tuple(t.to(info.device) for t in held.shard(b, dp_rank, dims.dp)) for b in range(data.eval_batches)]
    saver, first = None, 0  # first: the step a resumed run continues from
    if spec.checkpoint is not None:
        from parallelisms.checkpoint import Saver, load

        if spec.checkpoint.resume:
            resumed = load(trainer, spec.checkpoint.resume, info.rank)
            first = resumed.step
            if resumed.data_state is not None and hasattr(loader, "load_state_dict"):
                loader.load_state_dict(resumed.data_state)
                if balance is not None:
                    balance.load_state_dict(resumed.data_state)
                if trainer.ep_balance is not None:  # the saved placement: weights and moments move to it
                    trainer.ep_balance.load_state_dict(resumed.data_state, trainer.optimizers)
        if spec.checkpoint.save_dir:
            saver = Saver(spec.checkpoint.save_dir, spec.checkpoint.save_every, spec.checkpoint.async_save, comms,
                          info.rank, spec.checkpoint.meta, info.device)
    metrics = (MetricsWriter(spec.metrics_path, spec.tensorboard_dir, keep_until=first if first else None)
               if info.rank == 0 and (spec.metrics_path or spec.tensorboard_dir) else None)
    logging = bool(spec.metrics_path or spec.tensorboard_dir)
    # a few redraws a second at most, and none into a log (stderr not a terminal: every rank shares the launcher's)
    bar = spec.progress and _shows_a_bar()
    averaged = logging or bar  # every rank: the per-step loss is all-reduced, the rank average the bar and log show
    steps = range(first, spec.train.steps)
    if bar and info.rank == 0:
        from tqdm import tqdm
        steps = tqdm(steps, desc=f"train {spec.parallel.label()}", unit="step", dynamic_ncols=True, mininterval=0.5,
                     initial=first, total=spec.train.steps)
    tokens_per_step = spec.train.global_batch * spec.train.seq_len
    # compact: a long run's memory stays flat (parallelisms.step_log); a step without a norm (None) ends the norms
    losses, step_times, grad_norms = LossLog(), array("d"), array("d")
    ledger_marks, first_starts, eval_losses = [], [], []
    overlap_sum = overlap_first = None  # exposed communication, summed as the run goes (the first step apart)
    nonfinite, skipped, save_times, saved = None, 0, [], []
    held: list[dict] = []  # rank 0's metrics records waiting for their steps' straggler figures
    for step in steps:
        if balance is None:
            inputs, targets = (t.to(info.device) for t in loader.next_shard(dp_rank, dims.dp))
        else:  # this rank's measured share of the global batch, its loss weighted by it
            inputs, targets = (t.to(info.device) for t in balance.rows_of(*loader.batch(loader.step)))
            loader.step += 1
            trainer.forward_backward.weight = balance.weight
        if len(ledger_marks) < 2:  # where the first step and the measured ones begin (the ledger keeps sums)
            ledger_marks.append(comms.ledger.mark())
        watch.start_step()
        start = Timeline.now()
        if len(first_starts) < 2:
            first_starts.append(start)
        loss = trainer.train_step(inputs, targets)
        if info.device.type == "cuda":  # the step's kernels run asynchronously: its time ends when they do
            torch.cuda.synchronize(info.device)
        end = Timeline.now()
        # rank 0: the straggler figures of the steps handed over now (all, before a checkpoint)
        late = watch.end_step((start, end), exchange=saver is not None and saver.due(step + 1))
        if balance is not None:
            balance.after_step(step, trainer.forward_backward.compute_ns)
        if experts is not None:
            experts.after_step()
        if trainer.ep_balance is not None:
            trainer.ep_balance.rebalance_if_due(step, trainer.optimizers)
        losses.append(loss)
        if trainer.grad_norm is None:
            grad_norms = None
        elif grad_norms is not None:
            grad_norms.append(trainer.grad_norm.item())
        step_times.append((end - start) / 1e9)
        overlap_step = comms.timeline.step_stats(start, end) if trace else None
        if trace:
            overlap_first = overlap_first or overlap_step
            overlap_sum = _sum_stats([overlap_sum, overlap_step]) if overlap_sum else overlap_step
        eval_loss = None
        if evaluation is not None and (step + 1 == spec.train.steps or data.eval_every and
                                       (step + 1) % data.eval_every == 0):
            eval_loss = trainer.evaluate(evaluation).item()
            eval_losses.append([step + 1, eval_loss])
        mean = _rank_average(comms, loss) if averaged else None
        if metrics is not None:
            held.append(_log_step(trainer, step, mean, eval_loss, tokens_per_step, (start, end), overlap_step))
            _release(metrics, held, late)
        if hasattr(steps, "set_postfix"):  # the loss as the summary shows it: the mean over the data-parallel ranks
            steps.set_postfix(loss_rank_mean=f"{mean:.4f}", tok_s=f"{tokens_per_step / step_times[-1]:,.0f}",
                              refresh=False)  # the bar redraws on its own clock (mininterval)
        if spec.train.nonfinite is not NonFinite.CONTINUE:
            nonfinite = _nonfinite(loss, trainer, comms, step + 1, info)
            if nonfinite is not None and spec.train.nonfinite is NonFinite.SKIP:
                nonfinite, skipped = None, skipped + 1
            elif nonfinite is not None:
                break  # stop: every rank agrees (one all-reduce); cmd_train names the step and the rank
        if saver is not None and (saver.due(step + 1) or step + 1 == spec.train.steps):
            began = Timeline.now()
            data_state = getattr(loader, "state_dict", lambda: None)()
            for part in (balance, trainer.ep_balance):
                data_state = data_state if part is None else {**(data_state or {}), **part.state_dict()}
            saver.save(trainer, step + 1, data_state)
            save_times.append((Timeline.now() - began) / 1e9)
            saved.append(step + 1)
        _test_kill(info, step + 1)
    figures = watch.flush()  # the steps not handed over yet
    if metrics is not None:
        _release(metrics, held, figures)
    loop_end = Timeline.now()
    if saver is not None:
        saver.close()
    if metrics is not None:
        metrics.close()

    # Reporting: one all-reduce of every step's loss over the data-parallel ranks, outside the timed steps.
    with comms.ledger.in_phase("report"):
        losses = comms["dp_cp"].all_reduce(losses.stacked()) / (dims.dp * dims.cp)
        measured = slice(1, None) if len(step_times) > 1 else slice(None)  # the first step warms up
        # training only: one-off setup (DDP's bucket rebuild after the first step), validation and reporting left out
        step_comm = comms.ledger.summary(since=ledger_marks[measured][0], per=len(step_times[measured]),
                                         exclude_phases=("report", "setup", "eval", "checkpoint"))
        overlap = overlap_sum if not trace or len(step_times) == 1 else {  # the measured steps: all but the first
            k: overlap_sum[k] - overlap_first[k] for k in overlap_sum}
        expert_load = experts.report(comms, dims.tp) if experts is not None else None
        gathered = _gather_objects(comms, {"overlap": overlap, "spans": comms.timeline.spans if trace else [],
                                           "memory": trainer.memory_report()}, info.world_size)
    state = trainer.full_state_dict() if spec.collect_state else None
    extra = trainer.report()
    trainer.close()  # only after success: a failing rank keeps its groups until it exits (see launch.py)
    if info.rank != 0:
        return None
    median = statistics.median(step_times[measured])
    report = {
        "world_size": info.world_size, "layout": spec.parallel.label(), "steps": spec.train.steps,
        "first_step": first + 1,
        "loss_first": losses[0].item(), "loss_last": losses[-1].item(), "losses": losses.tolist(),
        "grad_norms": None if grad_norms is None else grad_norms.tolist(),
        "step_time_s": median, "tokens_per_s": tokens_per_step / median, "comm": step_comm,
        "lr_last": trainer.lr,
        "memory": gathered[0]["memory"], "memory_per_rank": [g["memory"] for g in gathered],
        "stragglers": watch.result(),
        # the loop's time a step from the second step's start, the report's hand-overs included (bench straggler-cost)
        "loop_time_s": (loop_end - first_starts[measured][0]) / len(step_times[measured]) / 1e9,
    }
    report.update(extra)
    if balance is not None:
        report["dp_balance"] = balance.report()
    if expert_load is not None:
        report["expert_load"] = expert_load
    if trainer.ep_balance is not None:
        report["ep_balance"] = trainer.ep_balance.report()
    if spec.train.nonfinite is not NonFinite.CONTINUE:
        report.update(nonfinite=nonfinite, skipped_steps=skipped)
    if save_times:
        from parallelisms.checkpoint import checkpoint_dir

        report["save_s"] = save_times
        report["checkpoints"] = [str(checkpoint_dir(spec.checkpoint.save_dir, s)) for s in saved]
    if first:
        report["resumed_from"] = {"step": first, "checkpoint": spec.checkpoint.resume}
    if eval_losses:
        report["eval_losses"] = eval_losses  # [step, validation loss]
    if trace:
        per_rank = [g["overlap"] for g in gathered]
        report["overlap_per_rank"] = per_rank
        report["exposed_comm_fraction"] = max(s["exposed_ns"] / max(s["wall_ns"], 1) for s in per_rank)
        report["spans"] = [g["spans"] for g in gathered]
        report["straggler_waits"] = watch.report.waits if watch.report is not None else []
    if state is not None:
        report["state"] = state
    return report


def _nonfinite(loss: torch.Tensor, trainer: Trainer, comms: Comms, step: int, info: RankInfo) -> dict | None:
    """Where the step went non-finite, the same on every rank: the lowest rank whose loss is not finite (one
    all-reduce over the world, outside the step's figures), or the gradient norm (global already); else None."""
    bad = torch.tensor([info.rank if not bool(torch.isfinite(loss).all()) else info.world_size], device=info.device)
    with comms.ledger.in_phase("report"):
        rank = int(comms["world"].all_reduce(bad, op=torch.distributed.ReduceOp.MIN) if info.world_size > 1 else bad)
    if rank < info.world_size:
        return {"step": step, "rank": rank, "what": "loss"}
    if trainer.skipped:
        return {"step": step, "rank": None, "what": "gradient norm"}
    return None


def _test_kill(info: RankInfo, step: int) -> None:
    """Tests only: ``PARALLELISMS_TEST_KILL_AT=RANK:STEP`` kills that rank after that step, in the first attempt
    of a torchrun launch (a restart runs through)."""
    import os
    import signal

    spec = os.environ.get("PARALLELISMS_TEST_KILL_AT")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and spec == f"{info.rank}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _shows_a_bar() -> bool:
    import sys

    return sys.stderr.isatty()


def _rank_average(comms: Comms, loss: torch.Tensor) -> float:
    """The step's loss averaged over dp x cp, as the report's losses are (an all-reduce outside the timed step,
    phase report; every rank calls it)."""
    with comms.ledger.in_phase("report"):
        return (comms["dp_cp"].all_reduce(loss.detach().reshape(1).clone()) / comms["dp_cp"].size).item()


def _log_step(trainer: Trainer, step: int, mean: float, eval_loss: float | None, tokens: int,
              window: tuple[int, int], overlap: dict | None) -> dict:
    """Rank 0's metrics record of a step: its loss averaged over dp x cp (:func:`_rank_average`), learning rate,
    gradient norm, tokens/s, this rank's exposed communication (with a timeline) and peak memory;
    :func:`_release` adds the step's stragglers and writes it."""
    from parallelisms.parallel.memory import process_peak_bytes

    seconds = (window[1] - window[0]) / 1e9
    exposed = overlap["exposed_ns"] / 1e9 if overlap is not None else None
    return {"step": step + 1, "loss": mean, "eval_loss": eval_loss, "lr": trainer.lr,
            "grad_norm": None if trainer.grad_norm is None else trainer.grad_norm.item(),
            "tokens_per_s": tokens / seconds, "step_time_s": seconds, "exposed_comm_s": exposed,
            "peak_memory_bytes": process_peak_bytes(), "skipped": trainer.skipped}


def _release(metrics: MetricsWriter, held: list, figures: list[dict]) -> None:
    """Write the held records (rank 0, oldest first) of the steps whose straggler figures (``figures``,
    :meth:`StragglerWatch.end_step`'s) came: a record waits for its step's hand-over, a few steps at most."""
    for late in figures:
        metrics.write({**held.pop(0), **late})


def _sum_stats(stats: list[dict]) -> dict:
    keys = ("comm_ns", "busy_ns", "exposed_ns", "wall_ns")
    return {k: sum(s[k] for s in stats) for k in keys}


def _gather_objects(comms: Comms, obj, world_size: int) -> list:
    """Every rank's ``obj`` on every rank (for the report only)."""
    return comms["world"].all_gather_object(obj) if world_size > 1 else [obj]


def run_layout(spec, placement, trace: bool = False):
    """Run ``train_rank`` for ``spec`` on its world size; rank 0's report (or None on other torchrun ranks),
    with the ``device`` and ``backend`` it ran on."""
    world = spec.parallel.dims.world_size
    if world == 1 and not under_torchrun():
        device = torch.device("cuda", 0) if placement.device == "cuda" else torch.device("cpu")
        report = train_rank(RankInfo(0, 1, 0, device), spec, trace)
    else:
        report = launch(train_rank, world, spec, trace, backend=placement.backend, timeout_s=spec.train.timeout_s)[0]
    if report is not None:
        report.update(device=placement.device, backend=placement.backend)
    return report
