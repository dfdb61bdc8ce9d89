"""The verbs' typed configurations and their results, the dicts that ``--json`` prints and the Python API
returns: train, verify, estimate and plan.

Each verb's configuration is a frozen dataclass (:class:`TrainRun`, :class:`VerifyRun`, :class:`EstimateRun`,
:class:`~parallelisms.perf.plan.PlanRun`) of the validated configs (:class:`~parallelisms.config.ModelConfig`,
``TrainConfig``, ``ParallelConfig``) and the verb's own options, built once, with every check, before any process
starts: from the command line's parsed flags or the Python API's keyword settings
(:func:`parallelisms.flags.settings`) by :func:`train_run`, :func:`verify_run`, :func:`estimate_run` and
:func:`plan_run`. The result functions take that configuration; the code that needs torch is imported inside the
function that runs it.

Torch-free at load, as :mod:`parallelisms.cli` and everything it imports (``tests/test_cli_light.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parallelisms.cli_configs import model_from_args, build_configs, prepare
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.data.options import RunFiles, check_run_files, run_files
from parallelisms.flags import Flag, check_writable, given_fields, number, settings
from parallelisms.options import Dtype, Precision, Schedule
from parallelisms.errors import require
from parallelisms.perf.shapes import PRICING_FLAGS, Pricing

if TYPE_CHECKING:
    from parallelisms.perf.plan import PlanRun


def run_layout(spec, placement, trace: bool = False):
    """:func:`parallelisms.training.run_layout`, imported when first used (torch loads with it)."""
    from parallelisms.training import run_layout as run

    return run(spec, placement, trace)


@dataclass(frozen=True)
class TrainRun:
    """``parallelisms train``'s configuration: the configs, the device placement, the files it reads and writes,
    its checkpoints (:class:`~parallelisms.resume.CheckpointOptions`, None without any), the ``--trace`` file and
    the ``--predict`` hardware (None: not asked for) as given and loaded."""

    model: ModelConfig
    train: TrainConfig
    parallel: ParallelConfig
    placement: Any                 # parallelisms.device.Placement
    files: RunFiles = RunFiles()
    checkpoint: Any = None         # parallelisms.resume.CheckpointOptions
    trace: str | None = None
    predict: str | None = None     # a hardware preset or a calibrate file
    hardware: Any = None           # --predict's, loaded (parallelisms.perf.hardware.Hardware)

    @property
    def save(self) -> str | None:
        """The ``--save`` directory, or None."""
        return self.checkpoint.save_dir if self.checkpoint else None


TRAIN_RUN_FLAGS = (  # train's own flags beside the configs' (data/options.py's, resume.py's)
    Flag("trace", "write the timeline as Chrome-trace JSON (Perfetto; parallelisms plot-trace draws it)",
         metavar="FILE"),
    Flag("predict", "print the step model's prediction against this run (hardware: cpu or a calibrate file)",
         metavar="HARDWARE", alone="cpu"),
)


def train_run(args, announce: bool = False) -> TrainRun:
    """The :class:`TrainRun` of ``args`` (parsed flags or the API's settings), every value checked before any
    process starts; ``announce`` prints the layout that will run."""
    from parallelisms.resume import checkpoint_flags, checkpoint_options

    own = given_fields(TRAIN_RUN_FLAGS, args)
    if own.get("trace"):
        check_writable("--trace", own["trace"])
    hardware = None
    if own.get("predict"):
        from parallelisms.perf.hardware import load_hardware
        hardware = load_hardware(own["predict"], "--predict")
    files = run_files(args)
    check_run_files(files)
    model, train, parallel, placement = prepare(args, announce)
    saving = checkpoint_flags(args)
    train = train.replace(nonfinite="skip" if saving.skip_nonfinite else "stop")
    checkpoint = checkpoint_options(saving, model, train, parallel)
    return TrainRun(model, train, parallel, placement, files, checkpoint, **own, hardware=hardware)


def train_report(run: TrainRun) -> dict | None:
    """Train as ``run`` says; rank 0's report (the ``--json`` object), None on other torchrun ranks."""
    from parallelisms.training import RunSpec

    from parallelisms.metrics import default_metrics_path

    model, train, parallel, files = run.model, run.train, run.parallel, run.files
    metrics = files.metrics or (default_metrics_path(run.save) if run.save else None)  # next to the checkpoints
    spec = RunSpec(model, train, parallel, progress=True, collect_state=bool(files.export_hf), metrics_path=metrics,
                   tensorboard_dir=files.tensorboard, init_from=files.init_from, checkpoint=run.checkpoint,
                   keep_spans=bool(run.trace or run.hardware))  # else summed per step: flat on long runs
    report = run_layout(spec, run.placement, trace=True)
    if report is None:  # a non-zero rank under torchrun
        return None
    if metrics:
        report["metrics"] = metrics
    from parallelisms.outputs import attempt, export_or_keep, last_checkpoint
    if files.export_hf:
        from parallelisms.hf import export_dtype
        last = report["first_step"] - 1 + len(report["losses"])
        export_or_keep(report, report.pop("state"), model, files.export_hf, last_checkpoint(run.save, last),
                       export_dtype(files.export_dtype, train.torch_dtype, parallel.mixed_precision))
    spans = report.pop("spans")
    waits = report.pop("straggler_waits", None) or []
    if run.trace:
        from parallelisms.comm.trace import Timeline, write_chrome_trace

        timelines = []
        for rank, rank_spans in enumerate(spans):
            t = Timeline(rank)
            t.spans = rank_spans
            timelines.append(t)
        if attempt(report, f"--trace {run.trace!r}", lambda: write_chrome_trace(timelines, run.trace, waits)):
            report["trace"] = run.trace
    if run.hardware:
        from parallelisms.perf.predict import compare
        report["prediction"] = compare(model, parallel, train, report, run.hardware, spans[0])
    from parallelisms.perf.model import predicted_comm_by_kind

    report["predicted_comm"] = predicted_comm_by_kind(model, parallel, train, dtype_bytes=2 if parallel.mixed_precision
                                                       == "bf16" else 4)
    return report


@dataclass(frozen=True)
class VerifyRun:
    """``parallelisms verify``'s configuration: the configs (batches that look up every token id), the device
    placement, the ``--tolerance`` (None: 1e-5, float64 1e-10) and whether ``--dtype`` was left unset (then a
    small fp32 run on the CPU is compared in float64 too)."""

    model: ModelConfig
    train: TrainConfig
    parallel: ParallelConfig
    placement: Any                 # parallelisms.device.Placement
    tolerance: float | None = None
    dtype_unset: bool = True


VERIFY_RUN_FLAGS = (Flag("tolerance", "relative tolerance (default 1e-5)", parse=number(0, 1)),)


def verify_run(args, announce: bool = False) -> VerifyRun:
    """The :class:`VerifyRun` of ``args`` (parsed flags or the API's settings), checked before any process
    starts; ``announce`` prints the layout that will run."""
    args = settings(args)
    model, train, parallel, placement = prepare(args, announce)
    # every token id in the batches, so that every vocabulary shard is looked up (parallelisms.data.loader)
    train = train.replace(data=dataclasses.replace(train.data, vocab_sweep=model.vocab_size))
    return VerifyRun(model, train, parallel, placement, **given_fields(VERIFY_RUN_FLAGS, args),
                     dtype_unset=args["dtype"] is None)


def _tolerance(run: VerifyRun, train: TrainConfig) -> float:
    from parallelisms.equivalence import TOLERANCE, TOLERANCE_FLOAT64

    if run.tolerance is not None:
        return run.tolerance
    return TOLERANCE_FLOAT64 if train.dtype is Dtype.FLOAT64 else TOLERANCE


def reference_for(model, train, parallel):
    """The single-process run a layout is compared with (see :mod:`parallelisms.verify`)."""
    import torch

    from parallelisms.equivalence import Run, batch_slices, reference_train, reference_train_bf16

    if parallel.dims.pp > 1 and parallel.schedule is Schedule.PIPEDREAM:  # asynchronous: its own delayed-update reference
        from parallelisms.parallel.pipeline.pipedream import pipedream_reference
        from parallelisms.parallel.pipeline.schedules import pipeline_microbatches
        return Run(*pipedream_reference(model, train, parallel.dims.pp, pipeline_microbatches(parallel),
                                        parallel.dims.dp, torch.bfloat16 if parallel.mixed_precision is Precision.BF16 else None))
    if parallel.mixed_precision is Precision.BF16:  # the same arithmetic in one process: bf16 grads of each batch slice
        return reference_train_bf16(model, train, splits=batch_slices(parallel, train))
    return reference_train(model, train, splits=batch_slices(parallel, train))


FLOAT64_UP_TO = "small"  # verify without --dtype runs float64 as well on the CPU for models up to this preset's size


def verify_result(run: VerifyRun) -> dict | None:
    """Verify as ``run`` says; the comparison (the ``--json`` object), None on non-zero torchrun ranks. Without
    ``--dtype``, an fp32 run on the CPU of a model up to ``small`` is followed by the same layout in float64
    (``float64``: its comparison; ``ok`` needs both), where the contract tightens to 1e-10 and a precision
    error fp32's rounding hides shows."""
    from parallelisms.config import PRESETS

    model, train, parallel, placement = run.model, run.train, run.parallel, run.placement
    result = _verify_dtype(run, train)
    if result is None or not (run.dtype_unset and placement.device == "cpu" and parallel.mixed_precision is Precision.FP32
                              and model.num_params() <= PRESETS[FLOAT64_UP_TO].num_params()):
        return result
    wide = _verify_dtype(run, train.replace(dtype="float64"))
    result["float64"] = {k: wide[k] for k in ("ok", "tolerance", "max_loss_rel_diff", "max_grad_norm_rel_diff",
                                              "max_param_rel_diff", "worst_param", "nonfinite")}
    result["ok"] = result["ok"] and wide["ok"]
    return result


def _verify_dtype(run: VerifyRun, train: TrainConfig) -> dict | None:
    """One comparison of ``run``'s layout with single-process training, in ``train.dtype``."""
    from parallelisms.training import RunSpec
    from parallelisms.equivalence import (batch_slices, bf16_samples, check_reference, compare_mixed_precision,
                                     compare_settled)

    model, parallel, placement = run.model, run.parallel, run.placement
    tolerance = _tolerance(run, train)
    # the reference first: settings under which it diverges are refused before any process starts
    reference = check_reference(reference_for(model, train, parallel), train)
    report = run_layout(RunSpec(model, train, parallel, collect_state=True, poison_fresh_memory=True), placement)
    if report is None:
        return None
    if parallel.mixed_precision is Precision.BF16:  # the same arithmetic, or else within the spread of bf16's roundings
        def samples():  # PipeDream's twin is its own delayed-update reference: fp32 is its one other computation
            if parallel.dims.pp > 1 and parallel.schedule is Schedule.PIPEDREAM:
                return [reference_for(model, train, dataclasses.replace(parallel, mixed_precision="fp32"))]
            return bf16_samples(model, train, batch_slices(parallel, train))
        result = compare_mixed_precision(report, reference, samples, tolerance)
    else:  # fp32 parameters beyond the tolerance: rounding? float64 training says
        result = compare_settled(report, reference, lambda: reference_for(model, train.replace(dtype="float64"),
                                                                          parallel), tolerance)
    return {"layout": report["layout"], "world_size": report["world_size"], "steps": train.steps,
            "dtype": train.dtype, "device": report["device"], "backend": report["backend"], **result}


@dataclass(frozen=True)
class EstimateRun:
    """``parallelisms estimate``'s configuration: the configs (checked as far as an estimate needs), the
    hardware and how it runs the work: the attention kernel, the non-GEMM ``kernels``, FP8 linear layers."""

    model: ModelConfig
    train: TrainConfig
    parallel: ParallelConfig
    hardware: Any                  # parallelisms.perf.hardware.Hardware
    attention: str = "flash"
    kernels: str = "eager"
    fp8: bool = False


def estimate_run(args) -> EstimateRun:
    """The :class:`EstimateRun` of ``args`` (parsed flags or the API's settings). It only computes, so layouts
    this runtime does not run yet are estimated all the same."""
    from parallelisms.perf.hardware import load_hardware

    pricing = Pricing(**given_fields(PRICING_FLAGS, args))
    hardware = load_hardware(pricing.hardware)
    model, train, parallel = build_configs(args, runtime=False)
    return EstimateRun(model, train, parallel, hardware, pricing.attention, pricing.kernels, pricing.fp8)


def estimate_result(run: EstimateRun) -> dict:
    """The estimate of ``run`` (the ``--json`` object)."""
    from parallelisms.perf.estimate import estimate

    return estimate(run.model, run.parallel, run.train, run.hardware, run.attention, fp8=run.fp8, kernels=run.kernels)


def plan_run(args) -> PlanRun:
    """The :class:`~parallelisms.perf.plan.PlanRun` of ``args`` (parsed flags or the API's settings), every value
    checked before the search: the layout flags given are fixed, the rest searched."""
    from parallelisms.perf.hardware import load_hardware
    from parallelisms.perf.plan import PLAN_FLAGS, Fixed, PlanRun, check_degrees

    args = settings(args)
    model = model_from_args(args)
    pricing = Pricing(**given_fields(PRICING_FLAGS, args))
    hardware = load_hardware(pricing.hardware)
    require(args["fsdp"] is None, f"--fsdp {args['fsdp']}: plan searches ZeRO stages (--zero 3 is --fsdp full_shard); "
                                  f"drop --fsdp or give --zero")
    train = TrainConfig(global_batch=args["global_batch"], seq_len=args["seq_len"], bucket_mb=args["bucket_mb"],
                        grad_accum=args["grad_accum"] or 1).validate(model)
    fixed = Fixed(**{f.name: args[f.name] for f in dataclasses.fields(Fixed)})
    own = given_fields(PLAN_FLAGS, args)
    check_degrees(own["gpus"], fixed)
    base = ParallelConfig(tp_overlap=args["tp_overlap"], tp_overlap_chunks=args.get("tp_overlap_chunks", 0),
                          mixed_precision=args["mixed_precision"], cp_attention=args["cp_attention"] or "ring",
                          fsdp_style=args["fsdp_style"])
    return PlanRun(model, train, base, fixed, hardware, **own, attention=pricing.attention, kernels=pricing.kernels,
                   fp8=pricing.fp8)


def plan_result(run: PlanRun) -> dict:
    """The plans ``run`` asks for (the ``--json`` object of ``parallelisms plan``)."""
    from parallelisms.perf.plan import plan_result as plans

    return plans(run)
