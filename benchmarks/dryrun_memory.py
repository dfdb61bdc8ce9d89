"""The dry run's peak memory per rank against the measured peak of the real run, on CPU layouts small enough
to run (docs/dryrun.md).

Measured: each rank's peak of the bytes the C allocator has handed out (glibc's mallinfo2, sampled after every
operator: :class:`parallelisms.dryrun.measured.HeapPeak`) over the model's build, ``parallelize`` and two
training steps, above its value just before the build. Dry run: :func:`parallelisms.dryrun.dry_run_rank`'s
peak (the same setup and two steps, fake tensors) of the same rank. Both count what the run allocates, not the
interpreter or the libraries.

    PYTHONPATH=src python3 benchmarks/dryrun_memory.py [--json]
"""

from __future__ import annotations

import json
import sys

from parallelisms.api import configure
from parallelisms.dryrun.measured import measured_peaks

LAYOUTS = {
    "ddp dp2": ["--dp", "2"],
    "zero3 dp2": ["--zero", "3", "--dp", "2"],
    "tp2 sp": ["--tp", "2", "--sp"],
    "pp2 1f1b": ["--pp", "2"],
    "cp2 ring": ["--cp", "2"],
}
SHAPE = ["--preset", "medium", "--global-batch", "8", "--seq-len", "512"]
MIB = 2 ** 20


def main() -> None:
    from parallelisms.dryrun import dry_run_rank

    print("| layout | measured heap peak (MiB, per rank) | dry run (MiB) | dry run vs measured |")
    print("|---|---|---|---|")
    rows = []
    for name, layout in LAYOUTS.items():
        argv = SHAPE + layout
        cfg = configure(argv)
        measured = measured_peaks(cfg.model, cfg.train, cfg.layout)
        dry = [dry_run_rank(cfg.model, cfg.train, cfg.layout, r).memory["peak_bytes"]
               for r in range(cfg.layout.dims.world_size)]
        diff = [d / m - 1 for d, m in zip(dry, measured)]
        rows.append({"layout": name, "measured_mib": [m / MIB for m in measured], "dry_run_mib": [d / MIB for d in dry],
                     "difference": [round(x, 4) for x in diff]})
        print(f"| {name} | {' / '.join(f'{m / MIB:.0f}' for m in measured)} | "
              f"{' / '.join(f'{d / MIB:.0f}' for d in dry)} | {' / '.join(f'{x:+.1%}' for x in diff)} |", flush=True)
    if "--json" in sys.argv:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
