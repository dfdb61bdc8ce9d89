"""The dry run's peak memory per rank against the measured peak of the real run, on CPU layouts small enough
to run (docs/dryrun.md).

Measured: each rank's resident memory grows from its value just before the model is built (imports done, the
process group up) to its peak over setup and two training steps: ``ru_maxrss`` at the end minus the resident
set (``/proc/self/statm``) before the build. Tensors of this size are mmap'd by the allocator and returned to the
system when freed, so resident memory follows live tensors. Dry run: :func:`parallelisms.dryrun.dry_run_rank`'s
peak (setup and two steps, fake tensors) of the same rank.

    PYTHONPATH=src python3 benchmarks/dryrun_memory.py
"""

from __future__ import annotations

import json
import os
import resource


from parallelisms.api import configure
from parallelisms.launch import launch

LAYOUTS = {
    "ddp dp2": ["--dp", "2"],
    "zero3 dp2": ["--zero", "3", "--dp", "2"],
    "tp2 sp": ["--tp", "2", "--sp"],
    "pp2 1f1b": ["--pp", "2"],
    "cp2 ring": ["--cp", "2"],
}
SHAPE = ["--preset", "medium", "--global-batch", "8", "--seq-len", "512"]


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measured(info, argv: list[str]) -> int:
    from parallelisms.api import batches
    from parallelisms.comm import CommLedger, Comms, Timeline
    from parallelisms.dryrun.fake import balance_routing
    from parallelisms.model import build_model
    from parallelisms.train import parallelize

    cfg = configure(argv)
    comms = Comms(cfg.layout.dims.build_meshes("cpu"), CommLedger(), Timeline(info.rank, enabled=False))
    before = _resident()
    model = build_model(cfg.model, cfg.train.seed, "cpu", cfg.train.torch_dtype)
    balance_routing(model)
    trainer = parallelize(model, cfg.layout, cfg.train, comms)
    for inputs, targets in batches(cfg.train, cfg.layout, steps=2, device="cpu"):
        trainer.train_step(inputs, targets)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    trainer.close()
    return peak


def main() -> None:
    from parallelisms.dryrun import dry_run_rank

    rows = []
    for name, layout in LAYOUTS.items():
        argv = SHAPE + layout
        cfg = configure(argv)
        measured = launch(_measured, cfg.layout.dims.world_size, argv, threads=1)
        dry = [dry_run_rank(cfg.model, cfg.train, cfg.layout, r).memory["peak_bytes"]
               for r in range(cfg.layout.dims.world_size)]
        rows.append({"layout": name, "resident_growth_mib": [m / 2 ** 20 for m in measured],
                     "dry_run_mib": [d / 2 ** 20 for d in dry],
                     "difference": [round(d / m - 1, 4) for d, m in zip(dry, measured)]})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
