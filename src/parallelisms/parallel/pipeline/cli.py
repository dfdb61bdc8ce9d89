"""``parallelisms simulate``: build a schedule, validate it, simulate it, optionally draw it.

The main CLI calls :func:`add_simulate_parser` with its subparsers and dispatches to
:func:`run_simulate`.  Times are per-microbatch times of one stage (one rank's whole share).
"""

from __future__ import annotations

import argparse
import sys

from parallelisms.errors import ConfigError, require
from parallelisms.flags import DEGREE, check_installed, check_writable, integer, json_line, number, settings
from .schedules import SCHEDULES, ScheduleError, build_schedule
from .simulate import Times, plot, simulate
from .validate import validate


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="simulate a pipeline schedule: bubble rate, makespan, memory",
                              description=__doc__.splitlines()[0])
    p.add_argument("--schedule", required=True, choices=SCHEDULES, help="the pipeline schedule")
    time = number(0, 1e9)  # finite sums: a makespan of a schedule at the size cap stays finite
    p.add_argument("--pp", type=DEGREE, required=True, help="pipeline ranks")
    p.add_argument("--microbatches", type=integer(1, 10**9), required=True, help="microbatches per step")
    p.add_argument("--chunks", type=integer(1, 10**9), default=None, help="virtual stages per rank (interleaved)")
    p.add_argument("--tf", type=time, default=1.0, help="forward time of one stage per microbatch")
    p.add_argument("--tb", type=time, default=1.0, help="input-gradient backward time")
    p.add_argument("--tw", type=time, default=1.0, help="weight-gradient backward time")
    p.add_argument("--tcomm", type=time, default=0.0, help="cost of each cross-rank dependency")
    p.add_argument("--plot", metavar="FILE.png|.svg", default=None, help="draw the schedule, one row per rank "
                                                                        "(needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def simulate_result(args) -> dict:
    """The simulation ``args`` (parsed flags or the Python API's settings: :func:`parallelisms.flags.settings`)
    ask for (the ``--json`` object), drawn to ``--plot`` when given; a bad schedule raises
    :class:`ScheduleError`."""
    args = settings(args)
    where = args["plot"]
    if where:  # the output first: a run is not thrown away for want of a place or a library to draw it
        require(where.lower().endswith((".png", ".svg")), f"--plot must name a .png or .svg file, got {where!r}")
        check_installed("--plot", "matplotlib", extra="plot")
        check_writable("--plot", where)
    schedule = build_schedule(args["schedule"], args["pp"], args["microbatches"], args["chunks"])
    validate(schedule)
    sim = simulate(schedule, Times(args["tf"], args["tb"], args["tw"], args["tcomm"]))
    if where:
        plot(sim, where)
    return sim.to_dict()


def run_simulate(args: argparse.Namespace) -> int:
    try:
        result = simulate_result(args)
    except (ScheduleError, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json_line(result))
    else:
        peaks = ", ".join(f"{p:g}" for p in result["peak_activations"])
        print(f"{result['schedule']}: pp={result['pp']} microbatches={result['microbatches']} chunks={result['chunks']}")
        print(f"  makespan {result['makespan']:g}, bubble rate {result['bubble_rate']:.4f}")
        print(f"  peak activations per rank (microbatches): {peaks}")
        if args.plot:
            print(f"  plot written to {args.plot}")
    return 0
