"""Per-rank memory accounting: what a run holds (measured from its tensors) and what ZeRO predicts.

ZeRO (Rajbhandari et al., SC'20, section 5) counts model states per rank for Psi parameters on N ranks:
parameters, gradients and optimizer state (Adam's two moments, plus fp32 master weights in mixed
precision). Stage 1 divides optimizer state by N, stage 2 also gradients, stage 3 also parameters.
Here bytes per element are explicit, so the same formulas cover fp32 training (4-byte parameters and
gradients, no separate master) and bf16 (2-byte parameters and gradients, 4-byte master copies).
:func:`engines_memory` reports the sharding engines (flat, per-parameter, buffer reuse), one or one per
pipeline stage.
torch is imported where a function first needs it: the performance model reads :func:`zero_formula` without it.
"""

from __future__ import annotations

import resource
import sys


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one storage counted once)."""
    import torch

    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizers) -> int:
    """Bytes of every tensor in the state of ``optimizers`` (one optimizer or several; Adam: exp_avg,
    exp_avg_sq, step)."""
    import torch

    optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers
    return tensor_bytes(v for opt in optimizers for state in opt.state.values() for v in state.values())


def process_peak_bytes() -> int:
    """Peak resident memory of this process (CPU: ru_maxrss) or peak CUDA allocation when on a GPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def zero_formula(numel: int, n: int, stage: int, param_bytes: int = 4, grad_bytes: int = 4,
                 master_bytes: int = 0, optim_bytes: int = 8, largest_unit: int = 0, bucket: int = 0,
                 master_grad_bytes: int = 0) -> dict:
    """Persistent bytes per rank predicted by ZeRO for ``numel`` parameters on ``n`` ranks at ``stage`` (0-3).

    ``master_bytes``: fp32 master copy per element (4 in mixed precision, 0 when the parameters are fp32);
    ``optim_bytes``: optimizer state per element (Adam: 8). ``master_grad_bytes``: the reduced fp32 gradient
    shard kept beside full bf16 gradients in stages 0-1 (4 in mixed precision). ``largest_unit`` (elements) is the largest
    unit gathered at a time in stage 3; ``bucket`` (bytes) the gradient bucket in flight in stage 2.
    """
    shard = numel / n
    params = numel * param_bytes if stage < 3 else shard * param_bytes
    grads = numel * grad_bytes + shard * master_grad_bytes if stage < 2 else shard * grad_bytes
    optimizer = (numel if stage < 1 else shard) * (optim_bytes + master_bytes)
    out = {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}
    out["peak_model_states"] = out["total"] + (largest_unit * param_bytes if stage == 3 else 0) + \
        (bucket if stage >= 2 else 0)
    return out


def memory_report(params_bytes: int, grads_bytes: int, optimizers, master_bytes: int = 0,
                  transient: dict | None = None) -> dict:
    """The ``memory`` entry of a train report: persistent bytes by kind, transient peaks, process peak."""
    optim = optimizer_state_bytes(optimizers) + master_bytes
    report = {"params": params_bytes, "grads": grads_bytes, "optimizer": optim,
              "persistent": params_bytes + grads_bytes + optim}
    transient = transient or {}
    report.update(transient)
    report["peak_model_states"] = report["persistent"] + sum(transient.values())
    report["process_peak"] = process_peak_bytes()
    return report


def engines_memory(engines, optimizers) -> dict:
    """:func:`memory_report` of sharding engines (one, or one per pipeline stage of this rank): each engine's
    ``held_bytes()`` (persistent ``params``, ``grads``, ``master`` and its transient peaks) summed, the peaks
    too (an upper bound when they do not coincide), and each engine's ``counts()`` (all-gathers, buffers:
    numbers or dicts of numbers) summed."""
    held = [engine.held_bytes() for engine in engines]
    total = {key: sum(h[key] for h in held) for key in held[0]}
    params, grads, master = (total.pop(key) for key in ("params", "grads", "master"))
    report = memory_report(params, grads, optimizers, master, total)
    for engine in engines:
        for key, value in engine.counts().items():
            previous = report.get(key)
            if isinstance(value, dict):
                report[key] = {k: (previous or {}).get(k, 0) + v for k, v in value.items()}
            else:
                report[key] = (previous or 0) + value
    return report
