"""The verbs' results, the dicts that ``--json`` prints and the Python API returns: train, verify, estimate
and plan; the code that needs torch is imported inside the function that runs it.

Torch-free at load, as :mod:`parallelisms.cli` and everything it imports (``tests/test_cli_light.py``).
"""

from __future__ import annotations

import dataclasses

from parallelisms.cli_configs import model_from_args, build_configs, prepare
from parallelisms.data.options import check_output_args
from parallelisms.flags import check_writable
from parallelisms.options import Dtype, Precision, Schedule


def run_layout(spec, placement, trace: bool = False):
    """:func:`parallelisms.training.run_layout`, imported when first used (torch loads with it)."""
    from parallelisms.training import run_layout as run

    return run(spec, placement, trace)


def train_report(args, announce: bool = False) -> dict | None:
    """Train as ``args`` say; rank 0's report (the ``--json`` object), None on other torchrun ranks."""
    from parallelisms.training import RunSpec

    from parallelisms.metrics import default_metrics_path
    from parallelisms.resume import checkpoint_options

    if args.trace:
        check_writable("--trace", args.trace)
    if args.predict:
        from parallelisms.perf.hardware import load_hardware
        hardware = load_hardware(args.predict, "--predict")
    check_output_args(args)
    model, train, parallel, placement = prepare(args, announce)
    train = train.replace(nonfinite="skip" if args.skip_nonfinite else "stop")
    checkpoint = checkpoint_options(args, model, train, parallel)
    metrics = args.metrics or (default_metrics_path(args.save) if args.save else None)  # next to the checkpoints
    spec = RunSpec(model, train, parallel, progress=True, collect_state=bool(args.export_hf), metrics_path=metrics,
                   tensorboard_dir=args.tensorboard, init_from=args.init_from, checkpoint=checkpoint,
                   keep_spans=bool(args.trace or args.predict))  # else summed per step: flat on long runs
    report = run_layout(spec, placement, trace=True)
    if report is None:  # a non-zero rank under torchrun
        return None
    if metrics:
        report["metrics"] = metrics
    from parallelisms.outputs import attempt, export_or_keep, last_checkpoint
    if args.export_hf:
        from parallelisms.hf import export_dtype
        last = report["first_step"] - 1 + len(report["losses"])
        export_or_keep(report, report.pop("state"), model, args.export_hf, last_checkpoint(args.save, last),
                       export_dtype(args.export_dtype, train.torch_dtype, parallel.mixed_precision))
    spans = report.pop("spans")
    waits = report.pop("straggler_waits", None) or []
    if args.trace:
        from parallelisms.comm.trace import Timeline, write_chrome_trace

        timelines = []
        for rank, rank_spans in enumerate(spans):
            t = Timeline(rank)
            t.spans = rank_spans
            timelines.append(t)
        if attempt(report, f"--trace {args.trace!r}", lambda: write_chrome_trace(timelines, args.trace, waits)):
            report["trace"] = args.trace
    if args.predict:
        from parallelisms.perf.predict import compare
        report["prediction"] = compare(model, parallel, train, report, hardware, spans[0])
    from parallelisms.perf.model import predicted_comm_by_kind

    report["predicted_comm"] = predicted_comm_by_kind(model, parallel, train, dtype_bytes=2 if parallel.mixed_precision
                                                       == "bf16" else 4)
    return report


def _tolerance(args, train) -> float:
    from parallelisms.equivalence import TOLERANCE, TOLERANCE_FLOAT64

    if args.tolerance is not None:
        return args.tolerance
    return TOLERANCE_FLOAT64 if train.dtype is Dtype.FLOAT64 else TOLERANCE


def reference_for(model, train, parallel):
    """The single-process run a layout is compared with (see :mod:`parallelisms.verify`)."""
    import torch

    from parallelisms.equivalence import Run, batch_slices, reference_train, reference_train_bf16

    if parallel.dims.pp > 1 and parallel.schedule is Schedule.PIPEDREAM:  # asynchronous: its own delayed-update reference
        from parallelisms.parallel.pipeline.pipedream import pipedream_reference
        return Run(*pipedream_reference(model, train, parallel.dims.pp, parallel.microbatches or 2 * parallel.dims.pp,
                                        parallel.dims.dp, torch.bfloat16 if parallel.mixed_precision is Precision.BF16 else None))
    if parallel.mixed_precision is Precision.BF16:  # the same arithmetic in one process: bf16 grads of each batch slice
        return reference_train_bf16(model, train, splits=batch_slices(parallel, train))
    return reference_train(model, train, splits=batch_slices(parallel, train))


FLOAT64_UP_TO = "small"  # verify without --dtype runs float64 as well on the CPU for models up to this preset's size


def verify_result(args, announce: bool = False) -> dict | None:
    """Verify as ``args`` say; the comparison (the ``--json`` object), None on non-zero torchrun ranks. Without
    ``--dtype``, an fp32 run on the CPU of a model up to ``small`` is followed by the same layout in float64
    (``float64``: its comparison; ``ok`` needs both), where the contract tightens to 1e-10 and a precision
    error fp32's rounding hides shows."""
    from parallelisms.config import PRESETS

    model, train, parallel, placement = prepare(args, announce)
    # every token id in the batches, so that every vocabulary shard is looked up (parallelisms.data.loader)
    train = train.replace(data=dataclasses.replace(train.data, vocab_sweep=model.vocab_size))
    result = _verify_dtype(args, model, train, parallel, placement)
    if result is None or not (args.dtype is None and placement.device == "cpu" and parallel.mixed_precision is Precision.FP32
                              and model.num_params() <= PRESETS[FLOAT64_UP_TO].num_params()):
        return result
    wide = _verify_dtype(args, model, train.replace(dtype="float64"), parallel, placement)
    result["float64"] = {k: wide[k] for k in ("ok", "tolerance", "max_loss_rel_diff", "max_grad_norm_rel_diff",
                                              "max_param_rel_diff", "worst_param", "nonfinite")}
    result["ok"] = result["ok"] and wide["ok"]
    return result


def _verify_dtype(args, model, train, parallel, placement) -> dict | None:
    """One comparison of the layout with single-process training, in ``train.dtype``."""
    from parallelisms.training import RunSpec
    from parallelisms.equivalence import (batch_slices, bf16_samples, check_reference, compare_mixed_precision,
                                     compare_settled)

    tolerance = _tolerance(args, train)
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


def estimate_result(args) -> dict:
    """The estimate ``args`` ask for (the ``--json`` object). It only computes, so layouts this runtime does
    not run yet are estimated all the same."""
    from parallelisms.perf.estimate import estimate
    from parallelisms.perf.hardware import load_hardware

    hw = load_hardware(args.hardware)
    model, train, parallel = build_configs(args, runtime=False)
    return estimate(model, parallel, train, hw, args.attention, fp8=args.fp8, kernels=args.kernels)


def plan_result(args) -> dict:
    """The plans ``args`` ask for (the ``--json`` object of ``parallelisms plan``)."""
    from parallelisms.perf.plan import plan_result as plans

    return plans(args, model_from_args(args))
