"""Memory before launch: whether a layout's ranks fit the memory of this machine, checked before any process
starts (``train`` and ``verify``; ``--force`` launches anyway).

Each rank needs what ``parallelisms estimate`` predicts for it (:func:`parallelisms.perf.step.memory_per_rank`:
parameters, gradients, optimizer state, activations and buffers, counted at this run's element size), the rotary
tables the model builds for all its positions (``max_position_embeddings``, which the estimate leaves out), plus
the process itself (the interpreter with torch loaded). On the CPU every rank of the machine draws on the same RAM,
so the need is the ranks' sum against the memory the kernel reports available (``MemAvailable``); on CUDA each
rank has a GPU of its own, so one rank's need is held against the smallest GPU's memory. A layout that does not
fit is refused in one line: by how much it is over, and the presets that would fit in its place.
"""

from __future__ import annotations

import dataclasses

from parallelisms.config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from parallelisms.errors import ConfigError
from parallelisms.units import size

PROCESS_BYTES = 400 * 2**20  # a rank's own process: the interpreter with torch and gloo loaded (about 220-400 MB here)
DTYPE_BYTES = {"float32": 4, "float64": 8}


def rank_bytes(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig) -> float:
    """Bytes one rank of this layout needs: the estimate's memory per rank (fp32 CPU accounting, scaled to the
    run's dtype) and the process."""
    from parallelisms.perf.estimate import estimate
    from parallelisms.perf.hardware import PRESETS as HARDWARE

    total = estimate(model, parallel, train, HARDWARE["cpu"], simulate_schedule=False)["memory_per_rank"]["total"]
    element = DTYPE_BYTES.get(train.dtype, 4)
    return total * element / 4 + rotary_bytes(model, element) + PROCESS_BYTES


def rotary_bytes(model: ModelConfig, element: int) -> float:
    """The peak of building the rotary tables for ``max_seq_len`` positions: the positions, the angles
    [positions, head_dim / 2], and their cosines and sines (``model.transformer.rotary_tables``)."""
    return model.max_seq_len * (1 + 3 * model.head_dim // 2) * element


def available_cpu_bytes() -> int | None:
    """The memory the kernel can give new work without swapping (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_bytes() -> int | None:
    """The smallest local GPU's memory (total: reading free memory would open a CUDA context in the launcher)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def check_fits(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, device: str, local_ranks: int,
               model_name: str, available: int | None = None) -> None:
    """Raise :class:`ConfigError` (one line) when this layout's ranks need more memory than the machine has
    (``model_name``: the preset or config file the message names); ``available`` defaults to this machine's (CPU: available RAM for all ``local_ranks``; CUDA: one GPU's)."""
    per_rank = rank_bytes(model, train, parallel)
    ranks = local_ranks if device == "cpu" else 1
    if available is None:
        available = available_cpu_bytes() if device == "cpu" else gpu_bytes()
    need = per_rank * ranks
    if available is None or need <= available:
        return
    where = (f"{local_ranks} rank(s) x {size(per_rank)} = {size(need)} of RAM, {size(available)} available"
             if device == "cpu" else f"{size(need)} per GPU, {size(available)} on each")
    rotary = rotary_bytes(model, DTYPE_BYTES.get(train.dtype, 4))
    rotary_note = (f"; the rotary tables for its {model.max_seq_len:,} positions (max_position_embeddings) take "
                   f"{size(rotary)} a rank" if rotary > per_rank / 2 else "")  # the estimate leaves them out
    fitting = [name for name in PRESETS
               if _preset_bytes(name, train, parallel) * ranks <= available and name != model_name]
    raise ConfigError(f"{parallel.label()} of {model_name} does not fit this machine: {where}, {size(need - available)} "
                      f"over (parallelisms estimate shows where it goes){rotary_note}; "
                      + (f"presets that fit this layout: {', '.join(fitting)}" if fitting else "no preset fits it here")
                      + "; --force launches anyway")


def _preset_bytes(name: str, train: TrainConfig, parallel: ParallelConfig) -> float:
    """One rank's need with preset ``name`` in place of the model (infinite where the layout does not divide it)."""
    try:
        from parallelisms.support import validate_layout

        model = PRESETS[name].validate()
        return rank_bytes(model, train, validate_layout(model, train, dataclasses.replace(parallel), runtime=False))
    except ConfigError:
        return float("inf")


# The kernel's counts of processes its out-of-memory killer ended: the system's, a cgroup v2's, a cgroup v1's
OOM_COUNTERS = (("/proc/vmstat", "oom_kill"), ("/sys/fs/cgroup/memory.events", "oom_kill"),
                ("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill"))
PRESSURE_AVG10 = 10.0  # % of the last 10 s some task stalled on memory: a kill with this much pressure is an OOM


def oom_signs() -> dict[str, int]:
    """The out-of-memory kill counters this process can read (path: count); empty where there are none."""
    signs = {}
    for path, key in OOM_COUNTERS:
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        signs[path] = int(value)
        except (OSError, ValueError):
            continue
    return signs


def _memory_pressure() -> float | None:
    """``some avg10`` of /proc/pressure/memory (None where the kernel keeps no pressure stall information)."""
    try:
        with open("/proc/pressure/memory") as f:
            return float(f.readline().split("avg10=")[1].split()[0])
    except (OSError, ValueError, IndexError):
        return None


def killed_for_memory(before: dict[str, int]) -> bool:
    """Whether a process SIGKILLed since ``before`` (:func:`oom_signs` then) was the OOM killer's: a counter
    rose, or, where no counter can be read, memory was under pressure."""
    after = oom_signs()
    if any(after.get(path, 0) > count for path, count in before.items()):
        return True
    pressure = _memory_pressure()
    return not before and pressure is not None and pressure >= PRESSURE_AVG10
