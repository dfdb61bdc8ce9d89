"""``parallelisms simulate``: build a schedule, validate it, simulate it, optionally draw it.

The main CLI calls :func:`add_simulate_parser` with its subparsers and dispatches to
:func:`run_simulate`, which builds a :class:`SimulateRun` first, as the Python API does. Times are per-microbatch times of one stage (one rank's whole share).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from parallelisms.errors import ConfigError, require
from parallelisms.flags import (DEGREE, Flag, add_flags, check_installed, check_writable, given_fields, integer,
                                json_line, number)
from .schedules import SCHEDULES, ScheduleError, build_schedule
from .simulate import Times, plot, simulate
from .validate import validate


@dataclass(frozen=True)
class SimulateRun:
    """``parallelisms simulate``'s configuration: the schedule and its shape (``chunks``: virtual stages per rank,
    None: the schedule's own), the per-microbatch times of one stage, and the ``plot`` file (None: not drawn)."""

    schedule: str
    pp: int
    microbatches: int
    chunks: int | None = None
    tf: float = 1.0
    tb: float = 1.0
    tw: float = 1.0
    tcomm: float = 0.0
    plot: str | None = None

    @property
    def times(self) -> Times:
        return Times(self.tf, self.tb, self.tw, self.tcomm)


TIME = number(0, 1e9)  # finite sums: a makespan of a schedule at the size cap stays finite
SIMULATE_FLAGS = (
    Flag("schedule", "the pipeline schedule", choices=SCHEDULES, required=True),
    Flag("pp", "pipeline ranks", parse=DEGREE, required=True),
    Flag("microbatches", "microbatches per step", parse=integer(1, 10**9), required=True),
    Flag("chunks", "virtual stages per rank (interleaved)", parse=integer(1, 10**9)),
    Flag("tf", "forward time of one stage per microbatch", parse=TIME),
    Flag("tb", "input-gradient backward time", parse=TIME),
    Flag("tw", "weight-gradient backward time", parse=TIME),
    Flag("tcomm", "cost of each cross-rank dependency", parse=TIME),
    Flag("plot", "draw the schedule, one row per rank (needs matplotlib)", metavar="FILE.png|.svg"),
)


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="simulate a pipeline schedule: bubble rate, makespan, memory",
                              description=__doc__.splitlines()[0])
    add_flags(p, SIMULATE_FLAGS, SimulateRun)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def simulate_run(args) -> SimulateRun:
    """The :class:`SimulateRun` of ``args`` (parsed flags or the Python API's settings:
    :func:`parallelisms.flags.settings`), its ``--plot`` file checked before anything is simulated: a run is not
    thrown away for want of a place or a library to draw it."""
    run = SimulateRun(**given_fields(SIMULATE_FLAGS, args))
    if run.plot:
        require(run.plot.lower().endswith((".png", ".svg")), f"--plot must name a .png or .svg file, got {run.plot!r}")
        check_installed("--plot", "matplotlib", extra="plot")
        check_writable("--plot", run.plot)
    return run


def simulate_result(run: SimulateRun) -> dict:
    """The simulation ``run`` asks for (the ``--json`` object), drawn to ``--plot`` when given; a bad schedule
    raises :class:`ScheduleError`."""
    schedule = build_schedule(run.schedule, run.pp, run.microbatches, run.chunks)
    validate(schedule)
    sim = simulate(schedule, run.times)
    if run.plot:
        plot(sim, run.plot)
    return sim.to_dict()


def run_simulate(args: argparse.Namespace) -> int:
    try:
        result = simulate_result(simulate_run(args))
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
