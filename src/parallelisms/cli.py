"""``parallelisms``: train, verify, bench and simulate from the command line.

Bad input is reported as one line (``error: ...``, exit code 2) before any process starts; a rank that
fails is reported by number (exit code 1).

Imports: this module and every module it imports at load are torch-free, so that ``--help``, ``--version``,
``estimate``, ``plan`` and ``simulate`` answer at once (see :mod:`parallelisms.cli_verbs`); a verb's code that needs
torch is imported inside the function that runs it. ``tests/test_cli_light.py`` guards this.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from parallelisms.support import validate_layout
from parallelisms.config import (ModelConfig, ParallelConfig, TrainConfig, load_hf_config, preset, PRESETS,
                                 with_positions)
from parallelisms.errors import ConfigError, LaunchError, StorageError, require
from parallelisms.data.options import add_data_args, add_output_args, check_data_args, check_output_args, data_settings
from parallelisms.flags import DEGREE, check_writable, integer, json_line, number, number_pair, slow_rank
from parallelisms.device import under_torchrun
from parallelisms.perf.shapes import add_hardware_args, add_shape_args, shape_from_args
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.cp_modes import MODES
from parallelisms.export import add_export_parser
from parallelisms.cli_verbs import add_bench_parser, add_calibrate_parser
from parallelisms.resume import add_checkpoint_args, add_verify_resume_parser

DEFAULT_TRAIN = dict(preset="tiny", dp=2, steps=300, global_batch=16, seq_len=64)
COUNT = integer(1, 10**9)  # steps, batch sizes, lengths: bounded, so no later arithmetic overflows
# Options that mean something only with a degree above 1 (default None: given or not is known); given without
# it they would be silently ignored. Their defaults are ParallelConfig's.
NEEDS_DEGREE = {"schedule": "pp", "microbatches": "pp", "chunks": "pp", "pp_balance": "pp", "cp_attention": "cp",
                "cp_ulysses_size": "cp"}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``, except where there is none to show (switches, unset options)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """One-line errors; ``--help`` shows every option's default."""

    def __init__(self, *args, formatter_class=_Formatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message):  # one line, no usage block
        raise ConfigError(f"{message} (see {self.prog} --help)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", default=DEFAULT_TRAIN["preset"], help=f"model preset: {', '.join(PRESETS)}")
    g.add_argument("--config", metavar="CONFIG_JSON", help="Hugging Face Llama-style config.json (overrides --preset)")
    add_shape_args(g)


def _add_layout_args(p: argparse.ArgumentParser, dp_default: int = 1) -> None:
    g = p.add_argument_group("layout (world size = pp x dp x cp x tp)")
    when = f"{dp_default} when --tp, --pp and --cp are 1, else 1" if dp_default > 1 else str(dp_default)
    g.add_argument("--dp", type=DEGREE, help=f"data-parallel degree (replicas for DDP; the shard group for "
                                              f"--zero/--fsdp); default {when}")
    p.set_defaults(dp_default=dp_default)
    g.add_argument("--dp-replicate", type=DEGREE, help="replicate degree of a 2-D data-parallel mesh (hybrid FSDP)")
    g.add_argument("--dp-shard", type=DEGREE, help="shard degree of a 2-D data-parallel mesh (hybrid FSDP)")
    for name, text in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert")):
        g.add_argument(f"--{name}", type=DEGREE, default=1, help=f"{text}-parallel degree")
    g.add_argument("--find-unused-parameters", action="store_true",
                   help="treat parameters with no gradient as zero instead of raising")
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--sp", action="store_true", help="Megatron sequence parallelism (needs --tp > 1)")
    g.add_argument("--tp-overlap", action="store_true", help="overlap the input-gradient all-reduce with dW")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="--zero 1/2: all-gather the updated parameters under the next forward (Megatron's)")
    g.add_argument("--tp-overlap-chunks", type=integer(0, 64), default=0,
                   help="with --tp-overlap, no --sp: hide the forward's all-reduces too, over N row blocks")
    g = p.add_argument_group("sharded data parallelism")
    g.add_argument("--zero", type=integer(0, 3), default=0, help="ZeRO stage 1, 2 or 3")
    g.add_argument("--fsdp", help="full_shard, shard_grad_op, no_shard, hybrid_shard or hybrid_shard_zero2")
    g.add_argument("--fsdp-prefetch", type=integer(1, 64), default=1,
                   help="ZeRO-3 / flat FSDP: units whose parameters are gathered ahead of the running one")
    g.add_argument("--fsdp-style", default="flat", help="flat (FSDP1), per_param (FSDP2) or reuse (YaFSDP)")
    g.add_argument("--mixed-precision", default="fp32", help="fp32 or bf16 (bf16 compute, fp32 master weights)")
    g = p.add_argument_group("data-parallel balance")
    g.add_argument("--dp-balance", default="even", help="split each global batch evenly (even) or in proportion "
                                                        "to each data-parallel rank's measured speed (measured)")
    g.add_argument("--rebalance-every", type=integer(0, 10**9), default=0,
                   help="with --dp-balance measured: re-measure and re-split every N steps (0: once)")
    g = p.add_argument_group("expert-parallel balance")
    g.add_argument("--ep-balance", default="even", help="experts split evenly over --ep (even) or placed by the "
                                                        "tokens measured per expert, EPLB-style (measured)")
    g.add_argument("--ep-redundant", type=integer(0, 10**6), default=0,
                   help="with --ep-balance measured: extra expert slots per ep rank, for copies of the hottest experts")
    g.add_argument("--ep-rebalance-every", type=integer(0, 10**9), default=0,
                   help="with --ep-balance measured: re-measure and re-place every N steps (0: once)")
    g = p.add_argument_group("activation memory")
    g.add_argument("--recompute", default="none", help="activation recomputation: none, selective or full")
    g = p.add_argument_group("context parallelism")
    g.add_argument("--cp-attention", help="; ".join(f"{m.name}: {m.summary}" for m in MODES.values()))
    g.add_argument("--cp-ulysses-size", type=COUNT, help="hierarchical: the all-to-all degree inside (a divisor of --cp)")
    g = p.add_argument_group("pipeline parallelism")
    g.add_argument("--schedule", help="gpipe, 1f1b (default), interleaved, zb-h1, zb-h2, zb-v, dualpipe, dualpipev "
                                      "or pipedream")
    g.add_argument("--microbatches", type=COUNT, help="microbatches per step (default 2 x pp)")
    g.add_argument("--chunks", type=COUNT, help="virtual stages per rank (interleaved: 2 or more)")
    g.add_argument("--pp-balance", help="cut stages by equal layer counts (layers, default) or by per-layer "
                                        "forward+backward time measured on rank 0 (measured)")


def _add_train_args(p: argparse.ArgumentParser, steps: int) -> None:
    g = p.add_argument_group("training")
    d = TrainConfig()
    g.add_argument("--steps", type=COUNT, default=steps, help="optimizer steps")
    g.add_argument("--global-batch", type=COUNT, default=DEFAULT_TRAIN["global_batch"], help="sequences per step")
    g.add_argument("--seq-len", type=integer(2, 10**9), default=DEFAULT_TRAIN["seq_len"], help="tokens per sequence")
    g.add_argument("--grad-accum", type=COUNT, default=1, help="microbatches per rank per step")
    g.add_argument("--lr", type=number(0, above=True), default=d.lr, help="AdamW learning rate")
    g.add_argument("--grad-clip", type=number(0), default=d.grad_clip, help="global-norm clip (0: off)")
    g.add_argument("--weight-decay", type=number(0), default=d.weight_decay,
                   help="AdamW's decoupled weight decay, of the weight matrices (not norms, biases, embeddings)")
    g.add_argument("--betas", type=number_pair(0, 1), default=d.betas, metavar="B1,B2", help="AdamW's betas")
    g.add_argument("--eps", type=number(0, above=True), default=d.eps, help="AdamW's epsilon")
    g.add_argument("--decay-all", action="store_true", help="decay every parameter, norms and embeddings included")
    # the data loader seeds step s with seed x 1_000_003 + s, which torch's 64-bit seeds hold for any seed below 2^32
    g.add_argument("--seed", type=integer(0, 2**32 - 1), default=d.seed, help="seed of the weights and the data")
    g.add_argument("--bucket-mb", type=number(0, 2**20, above=True), default=d.bucket_mb,
                   help="data-parallel gradient bucket cap")
    g.add_argument("--timeout", type=number(0, 10**6, above=True), default=d.timeout_s,
                   help="collective timeout, seconds")
    g.add_argument("--dtype", default=d.dtype, help="parameter dtype: float32, or float64 (rounding ~1e-16, so verify's "
                                                    "contract tightens to 1e-10)")
    g.add_argument("--slow-rank", type=slow_rank, metavar="R:F", help="make rank R's compute F times slower (real "
                                                                       "work; a straggler to see in the report)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")


def _add_device_arg(p: argparse.ArgumentParser) -> None:
    from parallelisms.device import DEVICES

    p.add_argument("--device", default="auto", help=f"{', '.join(DEVICES)}: auto is cuda (NCCL) when every rank on "
                                                    f"this machine has a GPU of its own, else cpu (gloo)")
    p.add_argument("--force", action="store_true", help="launch even where the layout's memory per rank (as estimate "
                                                        "predicts it) exceeds this machine's")


def build_configs(args, runtime: bool = True) -> tuple[ModelConfig, TrainConfig, ParallelConfig]:
    """Turn parsed arguments into validated configs (raises ConfigError); ``runtime`` False: only what an
    estimate needs (see ``validate_layout``)."""
    model = _model(args)
    options = _degree_options(args)
    train = TrainConfig(steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len,
                        grad_accum=args.grad_accum, lr=args.lr, grad_clip=args.grad_clip, seed=args.seed,
                        weight_decay=args.weight_decay, betas=tuple(args.betas), eps=args.eps,
                        decay_all=args.decay_all,
                        bucket_mb=args.bucket_mb, timeout_s=args.timeout, dtype=args.dtype or TrainConfig.dtype,
                        slow_rank=getattr(args, "slow_rank", None),
                        **(data_settings(args) if hasattr(args, "data") else {}))
    dims = ParallelDims(**_data_parallel_degrees(args), tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep)
    parallel = ParallelConfig(dims=dims, find_unused_parameters=args.find_unused_parameters,
                              sequence_parallel=args.sp, tp_overlap=args.tp_overlap, zero=args.zero,
                              overlap_param_gather=getattr(args, "overlap_param_gather", False),
                              tp_overlap_chunks=getattr(args, "tp_overlap_chunks", 0),
                              fsdp_prefetch=getattr(args, "fsdp_prefetch", 1),
                              fsdp=args.fsdp, fsdp_style=args.fsdp_style, mixed_precision=args.mixed_precision,
                              recompute=args.recompute, dp_balance=args.dp_balance,
                              rebalance_every=args.rebalance_every, ep_balance=args.ep_balance,
                              ep_redundant=args.ep_redundant, ep_rebalance_every=args.ep_rebalance_every, **options)
    parallel = validate_layout(model, train, parallel, runtime)
    require(train.slow_rank is None or train.slow_rank[0] < dims.world_size,
            lambda: f"--slow-rank {train.slow_rank[0]}:{train.slow_rank[1]:g} names rank {train.slow_rank[0]}, but the "
                    f"layout has {dims.world_size} rank(s); name a rank from 0 to {dims.world_size - 1}")
    if hasattr(args, "data"):
        check_data_args(model, train, parallel)
    if under_torchrun():  # the launcher fixed the world size: the layout must match it
        dims.check_world_size(int(os.environ["WORLD_SIZE"]))
    return model, train, parallel


def _model_config(args) -> ModelConfig:
    """--init-from's config.json, else --config, else --preset."""
    if getattr(args, "init_from", None):
        from parallelisms.hf import load_hf_model_config
        require(not args.config, f"--config with --init-from {args.init_from!r}: the model is the checkpoint's; "
                                 f"drop --config")
        return load_hf_model_config(args.init_from)
    return load_hf_config(args.config) if args.config else preset(args.preset).validate()


def _model(args) -> ModelConfig:
    """The model config, then the shape flags (--layers --hidden ...), which a checkpoint's model refuses."""
    shaped = shape_from_args(_model_config(args), args)
    require(not getattr(args, "init_from", None) or shaped == _model_config(args),
            f"shape flags with --init-from {getattr(args, 'init_from', '')!r}: the model is the checkpoint's; drop them")
    seq_len = getattr(args, "seq_len", 0) or 0
    if seq_len > shaped.max_seq_len:
        print(f"note: --seq-len {seq_len} is beyond the model's {shaped.max_seq_len} positions; rotary positions "
              f"extend to {seq_len}")
    return with_positions(shaped, seq_len)


def _degree_options(args) -> dict:
    """The NEEDS_DEGREE options the user gave, each refused without its degree above 1."""
    given = {name: getattr(args, name) for name in NEEDS_DEGREE if getattr(args, name) is not None}
    for name, value in given.items():
        flag, degree = f"--{name.replace('_', '-')}", NEEDS_DEGREE[name]
        require(getattr(args, degree) > 1, f"{flag} {value} applies only with --{degree} 2 or more, got --{degree} "
                                           f"{getattr(args, degree)}; add --{degree} 2 or drop {flag}")
    return given


def _data_parallel_degrees(args) -> dict:
    """--dp is the replica count for DDP and the shard group for ZeRO/FSDP; --dp-replicate/--dp-shard set both."""
    if args.dp_replicate is not None or args.dp_shard is not None:
        require(args.dp is None, f"--dp {args.dp} with --dp-replicate/--dp-shard: the data-parallel degree is "
                                 f"dp_replicate x dp_shard; drop --dp")
        return {"dp_replicate": args.dp_replicate or 1, "dp_shard": args.dp_shard or 1}
    dp = args.dp_default if args.dp is None and max(args.tp, args.pp, args.cp) == 1 else args.dp or 1
    sharded = args.zero > 0 or args.fsdp is not None
    return {"dp_shard": dp} if sharded else {"dp_replicate": dp}


def prepare(args, announce: bool = False):
    """Validated configs and the device placement of a train or verify run, all before any process starts;
    ``announce`` prints the layout that will run (rank 0 only under torchrun)."""
    from parallelisms.device import choose

    model, train, parallel = build_configs(args)
    placement = choose(args.device, parallel.dims.world_size)
    if not (getattr(args, "force", False) or under_torchrun()):  # torchrun's ranks start before any check could
        from parallelisms.device import local_ranks
        from parallelisms.fit import check_fits

        check_fits(model, train, parallel, placement.device, local_ranks(parallel.dims.world_size),
                   args.config or getattr(args, "init_from", None) or args.preset)
    if not getattr(args, "no_precheck", True):
        from parallelisms.dryrun.cli import precheck_before_launch
        precheck_before_launch(model, train, parallel)
    if announce and os.environ.get("RANK", "0") == "0":
        world = parallel.dims.world_size
        print(f"{args.command} {parallel.label()}: {world} rank{'s' if world > 1 else ''} on {placement.describe()}",
              flush=True)
    return model, train, parallel, placement


def run_layout(spec, placement, trace: bool = False):
    """:func:`parallelisms.train.run_layout`, imported when first used (torch loads with it)."""
    from parallelisms.train import run_layout as run

    return run(spec, placement, trace)


def train_report(args, announce: bool = False) -> dict | None:
    """Train as ``args`` say; rank 0's report (the ``--json`` object), None on other torchrun ranks."""
    from parallelisms.train import RunSpec

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


def cmd_train(args) -> int:
    from parallelisms.summary import print_train_summary

    report = train_report(args, announce=True)
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
    return _diverged(report, args.lr, args.skip_nonfinite) or (1 if report.get("output_errors") else 0)


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


def _tolerance(args, train) -> float:
    from parallelisms.verify import TOLERANCE, TOLERANCE_FLOAT64

    if args.tolerance is not None:
        return args.tolerance
    return TOLERANCE_FLOAT64 if train.dtype == "float64" else TOLERANCE


def reference_for(model, train, parallel):
    """The single-process run a layout is compared with (see :mod:`parallelisms.verify`)."""
    import torch

    from parallelisms.verify import Run, batch_slices, reference_train, reference_train_bf16

    if parallel.dims.pp > 1 and parallel.schedule == "pipedream":  # asynchronous: its own delayed-update reference
        from parallelisms.parallel.pipeline.pipedream import pipedream_reference
        return Run(*pipedream_reference(model, train, parallel.dims.pp, parallel.microbatches or 2 * parallel.dims.pp,
                                        parallel.dims.dp, torch.bfloat16 if parallel.mixed_precision == "bf16" else None))
    if parallel.mixed_precision == "bf16":  # the same arithmetic in one process: bf16 grads of each batch slice
        return reference_train_bf16(model, train, splits=batch_slices(parallel, train))
    return reference_train(model, train, splits=batch_slices(parallel, train))


def _rounding_note(explained: dict) -> str:
    if not explained:
        return ""
    from parallelisms.verify import ROUNDING_FACTOR

    ratio = max(e["vs_float64"] / e["reference_vs_float64"] for e in explained.values())
    return (f"; {len(explained)} tensor(s) beyond the tolerance measured against float64 training: "
            f"{ratio:.2f}x the fp32 single-process reference's own rounding (allowed {ROUNDING_FACTOR:g}x)")


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
    if result is None or not (args.dtype is None and placement.device == "cpu" and parallel.mixed_precision == "fp32"
                              and model.num_params() <= PRESETS[FLOAT64_UP_TO].num_params()):
        return result
    wide = _verify_dtype(args, model, train.replace(dtype="float64"), parallel, placement)
    result["float64"] = {k: wide[k] for k in ("ok", "tolerance", "max_loss_rel_diff", "max_grad_norm_rel_diff",
                                              "max_param_rel_diff", "worst_param", "nonfinite")}
    result["ok"] = result["ok"] and wide["ok"]
    return result


def _verify_dtype(args, model, train, parallel, placement) -> dict | None:
    """One comparison of the layout with single-process training, in ``train.dtype``."""
    from parallelisms.train import RunSpec
    from parallelisms.verify import check_reference, compare_mixed_precision, compare_settled

    tolerance = _tolerance(args, train)
    # the reference first: settings under which it diverges are refused before any process starts
    reference = check_reference(reference_for(model, train, parallel), train)
    report = run_layout(RunSpec(model, train, parallel, collect_state=True, poison_fresh_memory=True), placement)
    if report is None:
        return None
    if parallel.mixed_precision == "bf16":  # the same arithmetic, or else bf16's own envelope around fp32
        fp32 = reference_for(model, train, dataclasses.replace(parallel, mixed_precision="fp32"))
        result = compare_mixed_precision(report, reference, fp32, tolerance)
    else:  # fp32 parameters beyond the tolerance: rounding? float64 training says
        result = compare_settled(report, reference, lambda: reference_for(model, train.replace(dtype="float64"),
                                                                          parallel), tolerance)
    return {"layout": report["layout"], "world_size": report["world_size"], "steps": train.steps,
            "dtype": train.dtype, "device": report["device"], "backend": report["backend"], **result}


def cmd_verify(args) -> int:
    from parallelisms.device import Placement

    result = verify_result(args, announce=True)
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

    return plans(args, _model(args))


def cmd_estimate(args) -> int:
    from parallelisms.perf.estimate import explain

    result = estimate_result(args)
    print("\n".join(explain(result)))
    if args.check:  # the dry run of the same layout beside the formulas (imports torch)
        from parallelisms.estimate_check import check, check_lines

        model, train, parallel = build_configs(args, runtime=True)
        result["check"] = check(model, parallel, train, result["memory_per_rank"])
        print("\n".join(check_lines(result["check"])))
    if args.json:
        print(json_line(result))
    return 0 if not args.check or result["check"]["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    from parallelisms import __version__
    from parallelisms.dryrun.cli import add_dryrun_parser, add_precheck_arg

    parser = _Parser(prog="parallelisms", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"parallelisms {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("train", help="train a model on a layout")
    _add_model_args(p)
    _add_layout_args(p, dp_default=DEFAULT_TRAIN["dp"])
    _add_train_args(p, steps=DEFAULT_TRAIN["steps"])
    add_data_args(p)
    add_output_args(p)
    _add_device_arg(p)
    p.add_argument("--trace", metavar="FILE", help="write the timeline as Chrome-trace JSON (Perfetto; "
                                                   "parallelisms plot-trace draws it)")
    p.add_argument("--predict", nargs="?", const="cpu", metavar="HARDWARE",
                   help="print the step model's prediction against this run (hardware: cpu or a calibrate file)")
    add_checkpoint_args(p)
    add_precheck_arg(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("verify", help="check a layout against single-process training")
    _add_model_args(p)
    _add_layout_args(p, dp_default=DEFAULT_TRAIN["dp"])
    _add_train_args(p, steps=5)
    add_data_args(p, evaluation=False)
    _add_device_arg(p)
    p.add_argument("--tolerance", type=number(0, 1), help="relative tolerance (default 1e-5)")
    p.set_defaults(dtype=None)  # unset: float32, then float64 where cheap (verify_result)
    add_precheck_arg(p)
    p.set_defaults(func=cmd_verify)

    add_dryrun_parser(sub, _add_model_args, _add_layout_args, _add_train_args, build_configs)

    p = sub.add_parser("estimate", help="predict memory, communication and step time of a layout")
    _add_model_args(p)
    _add_layout_args(p)
    _add_train_args(p, steps=1)
    add_hardware_args(p)
    p.add_argument("--check", action="store_true", help="also dry-run the layout (the real code on fake tensors) and "
                                                        "print its memory per rank and bytes per collective beside "
                                                        "the estimate's, with the differences (exit 1 where they "
                                                        "disagree: memory beyond 5%%, any collective's bytes)")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("plan", help="search the fastest layout of --gpus N that fits (given layout flags are fixed)")
    _add_model_args(p)
    _add_layout_args(p)
    _add_train_args(p, steps=1)
    add_hardware_args(p)
    from parallelisms.perf.plan import add_plan_args, run_plan
    add_plan_args(p)
    p.set_defaults(func=lambda args: run_plan(args, _model(args)))

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
