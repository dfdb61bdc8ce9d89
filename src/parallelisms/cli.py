"""``parallelisms``: train, verify, bench and simulate from the command line.

Bad input is reported as one line (``error: ...``, exit code 2) before any process starts; a rank that
fails is reported by number (exit code 1).

Imports: this module and every module it imports at load are torch-free, so that ``--help``, ``--version``,
``estimate``, ``plan`` and ``simulate`` answer at once (see :mod:`parallelisms.cli_verbs`); a verb's code that needs
torch is imported inside the function that runs it. ``tests/test_cli_light.py`` guards this.

This module is the verbs: their parsers and what each prints. The shared flags are
:mod:`parallelisms.cli_args`, the configs they build :mod:`parallelisms.cli_configs`, and the results the verbs
print (and the Python API returns) :mod:`parallelisms.cli_results`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from parallelisms.config import TrainConfig
from parallelisms.options import NonFinite
from parallelisms.errors import ConfigError, LaunchError, StorageError
from parallelisms.data.options import add_data_args, add_output_args
from parallelisms.flags import add_flags, json_line
from parallelisms.perf.shapes import add_hardware_args
from parallelisms.export import add_export_parser
from parallelisms.cli_args import (DEFAULT_TRAIN, Parser, add_device_args, add_layout_args, add_model_args,
                                   add_train_args)
from parallelisms.cli_configs import build_configs, prepare
from parallelisms.cli_results import (TRAIN_RUN_FLAGS, VERIFY_RUN_FLAGS, TrainRun, VerifyRun, estimate_result,
                                      estimate_run, plan_result, plan_run, run_layout, train_report, train_run,
                                      verify_result, verify_run)
from parallelisms.cli_verbs import add_bench_parser, add_calibrate_parser
from parallelisms.resume import add_checkpoint_args, add_verify_resume_parser


def cmd_train(args) -> int:
    from parallelisms.summary import print_train_summary

    run = train_run(args, announce=True)
    report = train_report(run)
    if report is None:
        return 0
    defaults = vars(build_parser().parse_args(["verify"]))
    defaults["dtype"] = TrainConfig.dtype  # verify's unset --dtype runs this one first: not a flag to suggest
    print_train_summary(report, args, defaults)
    if "prediction" in report:
        from parallelisms.perf.predict import format_comparison
        print(format_comparison(report["prediction"]))
    if "exported_hf" in report:
        print(f"exported to {report['exported_hf']} (Hugging Face Llama)")
    if args.json:
        print(json_line(report))
    for line in report.get("output_errors", []):  # after the report: the results are printed whatever failed
        print(f"error: {line}", file=sys.stderr)
    return _diverged(report, run.train.lr, run.train.nonfinite is NonFinite.SKIP) or (1 if report.get("output_errors") else 0)


def _diverged(report: dict, lr: float, skip_nonfinite: bool = False) -> int:
    """Exit code 1 and one line naming the step (and the rank) where the loss or the gradient went non-finite;
    0 when it stayed finite."""
    losses, first, where = report["losses"], report.get("first_step", 1), report.get("nonfinite")
    if report.get("skipped_steps"):
        print(f"warning: skipped {report['skipped_steps']} step(s) whose loss or gradient was not finite "
              f"(--skip-nonfinite)", file=sys.stderr)
    if skip_nonfinite:
        return 0
    step = next((i for i, loss in enumerate(losses) if not math.isfinite(loss)), None)
    if step is None and where is None:
        return 0
    if where is not None and where["what"] != "loss":
        print(f"error: training stopped: the gradient norm became non-finite at step {where['step']} of "
              f"{report['steps']}; lower --lr (got {lr:g}) or pass --skip-nonfinite", file=sys.stderr)
        return 1
    rank = f" on rank {where['rank']}" if where is not None else ""
    print(f"error: training diverged: the loss became {losses[step]}{rank} at step {first + step} of {report['steps']}"
          + (f" (last finite loss {losses[step - 1]:.4f})" if step else "")
          + f"; lower --lr (got {lr:g})" + (" or pass --skip-nonfinite" if where is not None else ""),
          file=sys.stderr)
    return 1


def _rounding_note(explained: dict) -> str:
    if not explained:
        return ""
    from parallelisms.equivalence import ROUNDING_FACTOR

    ratio = max(e["vs_float64"] / e["reference_vs_float64"] for e in explained.values())
    return (f"; {len(explained)} tensor(s) beyond the tolerance measured against float64 training: "
            f"{ratio:.2f}x the fp32 single-process reference's own rounding (allowed {ROUNDING_FACTOR:g}x)")


def cmd_verify(args) -> int:
    from parallelisms.device import Placement

    result = verify_result(verify_run(args, announce=True))
    if result is None:
        return 0
    norms = ("n/a (per-stage updates)" if result["max_grad_norm_rel_diff"] is None
             else f"{result['max_grad_norm_rel_diff']:.2e}")
    print(f"{result['layout']} on {Placement(result['device'], result['backend']).describe()} vs single process over "
          f"{result['steps']} steps ({result['dtype']}): max loss rel diff "
          f"{result['max_loss_rel_diff']:.2e}, max grad norm rel diff {norms}, max param rel diff "
          f"{result['max_param_rel_diff']:.2e} ({result['worst_param']}), tolerance {result['tolerance']:.0e}: "
          f"{'ok' if result['ok'] else 'MISMATCH'}"
          + (f"; first non-finite value: {result['nonfinite']}" if result["nonfinite"] else "")
          + _rounding_note(result.get("rounding_explained", {}))
          + (f"; bf16 envelope: {result['envelope']:.2f}x single-process bf16's own distance from fp32 "
             f"(allowed {result['envelope_limit']:g}x)" if "envelope" in result else ""))
    if "float64" in result:
        wide = result["float64"]
        print(f"the same in float64: max loss rel diff {wide['max_loss_rel_diff']:.2e}, max param rel diff "
              f"{wide['max_param_rel_diff']:.2e} ({wide['worst_param']}), tolerance {wide['tolerance']:.0e}: "
              f"{'ok' if wide['ok'] else 'MISMATCH'}" + (f"; first non-finite value: {wide['nonfinite']}"
                                                          if wide["nonfinite"] else ""))
    if args.json:
        print(json_line(result))
    return 0 if result["ok"] else 1


def cmd_verify_resume(args) -> int:
    from parallelisms.verify_resume import verify_resume

    return verify_resume(args, lambda argv: prepare(build_parser().parse_args(["verify", *argv])), run_layout)


def cmd_estimate(args) -> int:
    from parallelisms.perf.estimate import explain

    result = estimate_result(estimate_run(args))
    print("\n".join(explain(result)))
    if args.check:  # the dry run of the same layout beside the formulas (imports torch)
        from parallelisms.estimate_check import check, check_lines

        model, train, parallel = build_configs(args, runtime=True)
        result["check"] = check(model, parallel, train, result["memory_per_rank"])
        print("\n".join(check_lines(result["check"])))
    if args.json:
        print(json_line(result))
    return 0 if not args.check or result["check"]["ok"] else 1


def cmd_plan(args) -> int:
    from parallelisms.perf.plan import plan_lines

    result = plan_result(plan_run(args))
    for line in plan_lines(result["plans"]):
        print(line)
    if args.json:
        print(json_line(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from parallelisms import __version__
    from parallelisms.dryrun.cli import add_dryrun_parser, add_precheck_arg

    parser = Parser(prog="parallelisms", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"parallelisms {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("train", help="train a model on a layout")
    add_model_args(p)
    add_layout_args(p, dp_default=DEFAULT_TRAIN["dp"])
    add_train_args(p, steps=DEFAULT_TRAIN["steps"])
    add_data_args(p)
    add_output_args(p)
    add_device_args(p)
    add_flags(p, TRAIN_RUN_FLAGS, TrainRun)
    add_checkpoint_args(p)
    add_precheck_arg(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("verify", help="check a layout against single-process training")
    add_model_args(p)
    add_layout_args(p, dp_default=DEFAULT_TRAIN["dp"])
    add_train_args(p, steps=5)
    add_data_args(p, evaluation=False)
    add_device_args(p)
    add_flags(p, VERIFY_RUN_FLAGS, VerifyRun)
    p.set_defaults(dtype=None)  # unset: float32, then float64 where cheap (verify_result)
    add_precheck_arg(p)
    p.set_defaults(func=cmd_verify)

    add_dryrun_parser(sub, add_model_args, add_layout_args, add_train_args, build_configs)

    p = sub.add_parser("estimate", help="predict memory, communication and step time of a layout")
    add_model_args(p)
    add_layout_args(p)
    add_train_args(p, steps=1)
    add_hardware_args(p)
    p.add_argument("--check", action="store_true", help="also dry-run the layout (the real code on fake tensors) and "
                                                        "print its memory per rank and bytes per collective beside "
                                                        "the estimate's, with the differences (exit 1 where they "
                                                        "disagree: memory beyond 5%%, any collective's bytes)")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("plan", help="search the fastest layout of --gpus N that fits (given layout flags are fixed)")
    add_model_args(p)
    add_layout_args(p)
    add_train_args(p, steps=1)
    add_hardware_args(p)
    from parallelisms.perf.plan import add_plan_args
    add_plan_args(p)
    p.set_defaults(func=cmd_plan)

    add_calibrate_parser(sub)
    add_verify_resume_parser(sub)
    sub.choices["verify-resume"].set_defaults(func=cmd_verify_resume)
    add_export_parser(sub)

    from parallelisms.plot_trace import add_parser as add_plot_trace_parser
    add_plot_trace_parser(sub)

    add_bench_parser(sub)

    try:
        from parallelisms.parallel.pipeline.cli import add_simulate_parser, run_simulate
    except ImportError:  # the pipeline simulator is not in this build
        pass
    else:
        add_simulate_parser(sub)
        sub.choices["simulate"].set_defaults(func=run_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StorageError as exc:  # a one-process run's checkpoint or output write
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if os.environ.get("PARALLELISMS_DEBUG"):
            print(exc.details, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the launcher has ended every rank
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
