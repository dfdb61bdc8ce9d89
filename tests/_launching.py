"""Shared by the multi-process tests: launch an entry once per world size, on first use; train the layouts of
one world size; check a run against single-process training; run the single-process references on one thread."""

import functools
import contextlib

import torch

from parallelisms.launch import launch
from parallelisms.training import train_rank
from parallelisms.equivalence import TOLERANCE, compare, compare_settled, reference_train


def launch_once_per_world(entry, threads: int = 1):
    """world size -> rank 0's result of ``entry(info, world)``; each world size is launched at most once."""
    cache = {}

    def get(world: int):
        if world not in cache:
            cache[world] = launch(entry, world, world, threads=threads)[0]
        return cache[world]
    return get


def launch_reports(specs: dict):
    """name -> rank 0's report of ``specs[name]``; the specs of each world size train in one launch, on first use."""
    results = launch_once_per_world(functools.partial(train_each, specs=specs))
    return lambda name: results(specs[name].parallel.dims.world_size)[name]


def train_each(info, world: int, specs: dict) -> dict:
    """Rank 0's report of every ``RunSpec`` in ``specs`` (name -> spec) whose layout has ``world`` ranks."""
    out = {}
    for name, spec in specs.items():
        if spec.parallel.dims.world_size == world:
            report = train_rank(info, spec)
            if report is not None:
                out[name] = report
    return out


def settled(report: dict, model, train, reference=None, splits: int = 1, tolerance: float = TOLERANCE) -> dict:
    """``report`` compared with single-process training on ``splits`` batch slices (``reference``, else trained
    here), fp32 parameters beyond ``tolerance`` settled against float64 training as ``verify`` does
    (:func:`parallelisms.equivalence.compare_settled`)."""
    reference = reference or reference_train(model, train, splits=splits)
    return compare_settled(report, reference, lambda: reference_train(model, train.replace(dtype="float64"), splits=splits),
                           tolerance)


def assert_reproduces(report: dict, model, train, splits: int, tolerance: float = TOLERANCE) -> None:
    """Losses, gradient norms and final parameters within ``tolerance`` of single-process training on ``splits``
    batch slices (fp32 parameters beyond it settled against float64 training, as ``verify`` does); with clipping,
    every reference step was clipped and the run is far from the unclipped one (so the clip was exercised)."""
    reference = reference_train(model, train, splits=splits)
    result = settled(report, model, train, reference, splits, tolerance)
    assert result["ok"], result
    if train.grad_clip:
        assert min(reference.grad_norms) > train.grad_clip, reference.grad_norms
        unclipped = reference_train(model, train.replace(grad_clip=0.0), splits=splits)
        assert compare(report, unclipped)["max_param_rel_diff"] > 1e-3


def assert_pipeline_report(report: dict, pp: int) -> None:
    """A pipeline run's report: the activations held per rank peak where the schedule simulator says; the
    measured, simulated and in-run (the run's own latency and host time) bubble rates and per-stage times; the
    simulated makespan at least a rank's mean share of the work."""
    bubble = report["pipeline"]
    assert bubble["peak_held_per_rank"] == bubble["simulated_peak_per_rank"], bubble
    assert -1e-9 < bubble["simulated_bubble_rate"] < 1.0 and 0.0 < bubble["measured_bubble_rate"] < 1.0, bubble
    assert -1e-9 < bubble["simulated_bubble_rate_in_run"] < 1.0 and bubble["t_latency_in_run_s"] >= 0.0, bubble
    work = bubble["microbatches"] * sum(map(sum, bubble["stage_times_s"])) / pp  # a rank's mean busy time
    assert work * (1 - 1e-9) <= bubble["simulated_makespan_s"] < 10 * work, bubble
    assert len(bubble["stage_times_s"]) >= pp and all(f > 0 for f, _, _ in bubble["stage_times_s"]), bubble


@contextlib.contextmanager
def one_thread():
    """Single-process references on one thread: the models are tiny, and two threads on two cores busy
    with other tests were ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
