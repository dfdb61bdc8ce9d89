"""Process launch: torch's elastic launcher locally, or the current process when started by ``torchrun``.

``launch(entry, world_size, *args)`` runs ``entry(rank_info, *args)`` on every rank and returns the per-rank
results. Locally it uses ``torch.distributed.launcher.api.elastic_launch`` (the machinery of ``torchrun``),
so a failing rank stops the others and is reported by number; under ``torchrun`` (``TORCHELASTIC_RUN_ID``
set) it runs this process's rank only. Collectives time out after ``timeout_s``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record


class LaunchError(RuntimeError):
    """A rank failed; the message names it and its error, ``details`` holds its traceback."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


OVERSUBSCRIBED = 4  # ranks per CPU core beyond which a local launch warns (CPU ranks share the cores)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@record
def _worker(entry, args, backend: str, timeout_s: float, threads: int | None):
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if threads:
        torch.set_num_threads(threads)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)
    try:
        return entry(RankInfo(rank, world, local, device), *args)
    finally:
        dist.destroy_process_group()


def launch(entry, world_size: int, *args, backend: str | None = None, timeout_s: float = 300.0,
           threads: int | None = None) -> list:
    """Run ``entry(RankInfo, *args)`` on ``world_size`` ranks; return the results indexed by rank.

    Under ``torchrun`` only this process's rank runs and the list holds its result alone. ``threads``
    sets ``torch.set_num_threads`` per rank (default: cores divided among the local ranks).
    """
    backend = backend or default_backend()
    if under_torchrun():
        return [_worker(entry, args, backend, timeout_s, threads)]
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cores = os.cpu_count() or 1
    if backend != "nccl" and world_size > OVERSUBSCRIBED * cores:
        print(f"warning: {world_size} ranks on {cores} CPU cores ({world_size / cores:.0f} per core): each rank is a "
              f"process with its own model copy, so this will be slow and use much memory", file=sys.stderr)
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    threads = threads or max(1, cores // world_size)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                          monitor_interval=0.05, start_method="spawn")
    try:
        results = elastic_launch(config, _worker)(entry, args, backend, timeout_s, threads)
    except ChildFailedError as exc:
        rank, failure = min(exc.failures.items())
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        lines = [ln for ln in str(message).strip().splitlines() if ln.strip()]
        raise LaunchError(f"rank {rank} failed (exit code {failure.exitcode}): "
                          f"{lines[-1] if lines else 'no error message'}", str(message)) from None
    return [results[r] for r in range(world_size)]
