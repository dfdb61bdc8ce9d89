"""From parsed arguments to validated configs: the model (preset, config.json or checkpoint, then the shape
flags), the layout's degrees and options, and the device placement, all before any process starts.

Torch-free, as :mod:`parallelisms.cli` and everything it imports at load (``tests/test_cli_light.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from parallelisms.support import validate_layout
from parallelisms.config import (PRESETS, TRAIN_FLAGS, ModelConfig, ParallelConfig, TrainConfig, load_hf_config,
                                 preset, with_positions)
from parallelisms.errors import require
from parallelisms.flags import DEGREE, Flag, given_fields, settings
from parallelisms.data.options import check_data_args, data_settings
from parallelisms.device import DEVICES, under_torchrun
from parallelisms.perf.shapes import shape_from_args
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.registry import OPTIONS, parallel_config

@dataclass(frozen=True)
class ModelSource:
    """Where the model's shape comes from: a preset, or a Hugging Face ``config.json`` (which overrides it); a
    checkpoint's (``--init-from``, :class:`~parallelisms.data.options.RunFiles`) overrides both."""

    preset: str = "tiny"
    config: str | None = None


MODEL_SOURCE_FLAGS = (
    Flag("preset", f"model preset: {', '.join(PRESETS)}"),
    Flag("config", "Hugging Face Llama-style config.json (overrides --preset)", metavar="CONFIG_JSON"),
)


@dataclass(frozen=True)
class Launch:
    """Where a train or verify run starts (``device``: :func:`parallelisms.device.choose`'s rule) and whether it
    starts where its memory per rank, as estimate predicts it, exceeds this machine's (``force``)."""

    device: str = "auto"
    force: bool = False


LAUNCH_FLAGS = (
    Flag("device", f"{', '.join(DEVICES)}: auto is cuda (NCCL) when every rank on this machine has a GPU of its own, "
                   f"else cpu (gloo)"),
    Flag("force", "launch even where the layout's memory per rank (as estimate predicts it) exceeds this machine's"),
)

@dataclass(frozen=True)
class DataParallelDegrees:
    """The data-parallel degrees as given (None: not given): ``dp`` (the replicas for DDP, the shard group for
    ZeRO/FSDP) or the two sides of a 2-D mesh (hybrid FSDP), which become
    :class:`~parallelisms.mesh.ParallelDims`' ``dp_replicate`` and ``dp_shard``."""

    dp: int | None = None
    dp_replicate: int | None = None
    dp_shard: int | None = None


DP_FLAGS = (  # --dp's help ends with the verb's default (parallelisms.cli_args.add_layout_args)
    Flag("dp", "data-parallel degree (replicas for DDP; the shard group for --zero/--fsdp)", parse=DEGREE),
    Flag("dp_replicate", "replicate degree of a 2-D data-parallel mesh (hybrid FSDP)", parse=DEGREE),
    Flag("dp_shard", "shard degree of a 2-D data-parallel mesh (hybrid FSDP)", parse=DEGREE),
)

# Options that mean something only with a degree above 1 (default None: given or not is known); given without
# it they would be silently ignored. Their defaults are ParallelConfig's.
NEEDS_DEGREE = {o.field: o.needs for o in OPTIONS.values() if o.needs}


def build_configs(args, runtime: bool = True) -> tuple[ModelConfig, TrainConfig, ParallelConfig]:
    """Turn a verb's settings (parsed ``args``, or the API's mapping: :func:`parallelisms.flags.settings`) into
    validated configs (raises ConfigError); ``runtime`` False: only what an estimate needs (see
    ``validate_layout``)."""
    args = settings(args)
    model = model_from_args(args)
    options = _degree_options(args)
    train = TrainConfig(**given_fields(TRAIN_FLAGS, args), **(data_settings(args) if "data" in args else {}))
    dims = ParallelDims(**_data_parallel_degrees(args), tp=args["tp"], pp=args["pp"], cp=args["cp"], ep=args["ep"])
    parallel = parallel_config(dims, **{o.field: args.get(o.dest, o.default) for o in OPTIONS.values() if not o.needs},
                               **options)
    parallel = validate_layout(model, train, parallel, runtime)
    require(train.slow_rank is None or train.slow_rank[0] < dims.world_size,
            lambda: f"--slow-rank {train.slow_rank[0]}:{train.slow_rank[1]:g} names rank {train.slow_rank[0]}, but the "
                    f"layout has {dims.world_size} rank(s); name a rank from 0 to {dims.world_size - 1}")
    if "data" in args:
        check_data_args(model, train, parallel)
    if under_torchrun():  # the launcher fixed the world size: the layout must match it
        dims.check_world_size(int(os.environ["WORLD_SIZE"]))
    return model, train, parallel


def _model_config(args: Mapping) -> ModelConfig:
    """--init-from's config.json, else --config, else --preset."""
    source = ModelSource(**given_fields(MODEL_SOURCE_FLAGS, args))
    if args.get("init_from"):
        from parallelisms.hf import load_hf_model_config
        require(not source.config, f"--config with --init-from {args['init_from']!r}: the model is the "
                                   f"checkpoint's; drop --config")
        return load_hf_model_config(args["init_from"])
    return load_hf_config(source.config) if source.config else preset(source.preset).validate()


def model_from_args(args) -> ModelConfig:
    """The model config, then the shape flags (--layers --hidden ...), which a checkpoint's model refuses."""
    args = settings(args)
    shaped = shape_from_args(_model_config(args), args)
    require(not args.get("init_from") or shaped == _model_config(args),
            f"shape flags with --init-from {args.get('init_from', '')!r}: the model is the checkpoint's; drop them")
    seq_len = args.get("seq_len", 0) or 0
    if seq_len > shaped.max_seq_len:
        print(f"note: --seq-len {seq_len} is beyond the model's {shaped.max_seq_len} positions; rotary positions "
              f"extend to {seq_len}")
    return with_positions(shaped, seq_len)


def _degree_options(args: Mapping) -> dict:
    """The NEEDS_DEGREE options the user gave, each refused without its degree above 1."""
    given = {name: args[name] for name in NEEDS_DEGREE if args[name] is not None}
    for name, value in given.items():
        flag, degree = OPTIONS[name].name, NEEDS_DEGREE[name]
        require(args[degree] > 1, f"{flag} {value} applies only with --{degree} 2 or more, got --{degree} "
                                  f"{args[degree]}; add --{degree} 2 or drop {flag}")
    return given


def _data_parallel_degrees(args: Mapping) -> dict:
    """--dp is the replica count for DDP and the shard group for ZeRO/FSDP; --dp-replicate/--dp-shard set both."""
    given = DataParallelDegrees(**given_fields(DP_FLAGS, args))
    dp, replicate, shard = given.dp, given.dp_replicate, given.dp_shard
    if replicate is not None or shard is not None:
        require(dp is None, f"--dp {dp} with --dp-replicate/--dp-shard: the data-parallel degree is "
                            f"dp_replicate x dp_shard; drop --dp")
        return {"dp_replicate": replicate or 1, "dp_shard": shard or 1}
    dp = args["dp_default"] if dp is None and max(args["tp"], args["pp"], args["cp"]) == 1 else dp or 1
    sharded = args["zero"] > 0 or args["fsdp"] is not None
    return {"dp_shard": dp} if sharded else {"dp_replicate": dp}


def prepare(args, announce: bool = False):
    """Validated configs and the device placement of a train or verify run, all before any process starts;
    ``announce`` prints the layout that will run (rank 0 only under torchrun)."""
    from parallelisms.device import choose

    args = settings(args)
    model, train, parallel = build_configs(args)
    launch = Launch(**given_fields(LAUNCH_FLAGS, args))
    placement = choose(launch.device, parallel.dims.world_size)
    if not (launch.force or under_torchrun()):  # torchrun's ranks start before any check could
        from parallelisms.device import local_ranks
        from parallelisms.fit import check_fits

        check_fits(model, train, parallel, placement.device, local_ranks(parallel.dims.world_size),
                   args["config"] or args.get("init_from") or args["preset"])
    if not args.get("no_precheck", True):
        from parallelisms.dryrun.cli import precheck_before_launch
        precheck_before_launch(model, train, parallel)
    if announce and os.environ.get("RANK", "0") == "0":
        world = parallel.dims.world_size
        print(f"{args['command']} {parallel.label()}: {world} rank{'s' if world > 1 else ''} on "
              f"{placement.describe()}", flush=True)
    return model, train, parallel, placement
