"""``parallelisms dryrun``, and the precheck ``train`` and ``verify`` run before launch (``--no-precheck``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from parallelisms.errors import require
from parallelisms.flags import Flag, add_flags, given_fields, integer


@dataclass(frozen=True)
class DryrunOptions:
    """``dryrun``'s own options beside the configs and the hardware: the ``gpus`` the layout must use (None: any),
    whether ``every_rank`` runs (else one per rank class) and whether the memory accounting is left out."""

    gpus: int | None = None
    every_rank: bool = False
    no_memory: bool = False


DRYRUN_FLAGS = (
    Flag("gpus", "the number of GPUs the layout must use (its product)", parse=integer(1, 2**20)),
    Flag("every_rank", "run every rank, not one per rank class"),
    Flag("no_memory", "leave out the memory accounting (faster)"),
)


def add_dryrun_parser(sub, add_model_args, add_layout_args, add_train_args, build_configs) -> None:
    """The ``dryrun`` verb, with the model, layout and training flags of ``train`` (the CLI's own adders and
    ``build_configs``, handed down so that this module imports nothing above it)."""
    from parallelisms.perf.shapes import add_hardware_args

    p = sub.add_parser("dryrun", help="run the real code of every rank class of a layout without data: collectives, "
                                      "memory per rank, collective-order proof")
    add_model_args(p)
    add_layout_args(p)
    add_train_args(p, steps=1)
    add_hardware_args(p)
    add_flags(p, DRYRUN_FLAGS, DryrunOptions)
    p.set_defaults(func=cmd_dryrun, build_configs=build_configs)


def dryrun_result(args) -> dict:
    from parallelisms.dryrun import dry_run
    from parallelisms.dryrun.report import dryrun_result as result_of
    from parallelisms.perf.hardware import load_hardware

    own = DryrunOptions(**given_fields(DRYRUN_FLAGS, args))
    model, train, parallel = args.build_configs(args, runtime=True)
    world = parallel.dims.world_size
    require(own.gpus is None or own.gpus == world,
            f"layout {parallel.dims.describe()} has pp x dp x cp x tp = {world} ranks, but --gpus is {own.gpus}; "
            f"change a degree so that the product is {own.gpus}, or use --gpus {world}")
    hardware = load_hardware(args.hardware)
    return result_of(dry_run(model, train, parallel, every_rank=own.every_rank, memory=not own.no_memory),
                     hardware.hbm_gb * 1e9)


def cmd_dryrun(args) -> int:
    from parallelisms.dryrun.report import check_fits, summary_lines
    from parallelisms.flags import json_line

    out = dryrun_result(args)
    print("\n".join(summary_lines(out)))
    if args.json:
        print(json_line(out))
    check_fits(out)
    return 0 if out["precheck"]["ok"] else 1


def precheck_before_launch(model, train, parallel) -> None:
    """The collective-order proof of ``train``/``verify``'s layout, before any process starts (no memory
    accounting); a violation ends the command in one line."""
    from parallelisms.dryrun import dry_run
    from parallelisms.errors import ConfigError

    import torch.distributed as dist

    if parallel.dims.world_size == 1 or dist.is_initialized():  # under torchrun the ranks are already up
        return
    try:
        check = dry_run(model, train, parallel, memory=False)["precheck"]
    except Exception as exc:  # noqa: BLE001 -- a layout the dry run cannot follow yet must still train
        import sys

        print(f"warning: precheck skipped: the dry run of {parallel.label()} failed ({exc.__class__.__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''})", file=sys.stderr)
        return
    if not check["ok"]:
        raise ConfigError(f"precheck: {check['violations'][0]} (--no-precheck skips this check)")


def add_precheck_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-precheck", action="store_true",
                   help="skip the collective-order proof (a dry run of the layout) before launch")


__all__ = ["add_dryrun_parser", "add_precheck_arg", "cmd_dryrun", "precheck_before_launch"]
