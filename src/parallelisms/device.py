"""Which device the ranks train on, and the process-group backend that goes with it (``--device``).

``auto`` picks CUDA when every rank on a machine can have a GPU of its own, else the CPU. The count that
matters is the ranks *per machine*: under ``torchrun`` that is ``LOCAL_WORLD_SIZE`` (``--nproc-per-node``),
so two 8-GPU machines running 16 ranks train on CUDA; a local launch puts every rank on this machine. CUDA
runs over NCCL, the CPU over gloo (as torch.distributed's own guidance); one process outside torchrun needs
no process group (backend ``none``). A request that cannot be met
(``--device cuda`` with fewer GPUs than local ranks) is refused before any process starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from parallelisms.errors import require

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


@dataclass(frozen=True)
class Placement:
    """Where a run's ranks live: ``device`` (cpu or cuda) and the process-group ``backend`` (gloo or nccl)."""

    device: str
    backend: str  # "none": one process, no process group

    def describe(self) -> str:
        return f"{self.device}, one process" if self.backend == "none" else f"{self.device} ({self.backend})"


def under_torchrun() -> bool:
    """Whether ``torchrun`` started this process as one rank (the launcher then runs this rank only)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def local_ranks(world_size: int) -> int:
    """Ranks on this machine: ``LOCAL_WORLD_SIZE`` under torchrun (ranks per node), else the whole world."""
    if under_torchrun() and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return world_size


def choose(requested: str, world_size: int) -> Placement:
    """The placement for ``--device requested`` with ``world_size`` ranks (see the module docstring)."""
    require(requested in DEVICES, f"unknown --device {requested!r}; choose {', '.join(DEVICES)}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per_machine = local_ranks(world_size)
    if requested == "auto":
        requested = "cuda" if gpus >= per_machine else "cpu"
    elif requested == "cuda":
        require(gpus >= per_machine, f"--device cuda needs a GPU for each of the {per_machine} ranks on this "
                                     f"machine, found {gpus}; use --device cpu, or fewer ranks per machine")
    return Placement(requested, BACKENDS[requested] if world_size > 1 or under_torchrun() else "none")
