"""The units per-parameter sharding (:mod:`parallelisms.parallel.fsdp2`, and buffer reuse,
:mod:`parallelisms.parallel.yafsdp`) communicates: a unit's parameter entries, its flat shard and the state of
its gathered weights in the current step; the copies between a flat tensor and the rank-major block a
collective moves; and the engine's accounting of the temporary buffers it allocates."""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.comm import Comm


class BufferStats:
    """The engine's own accounting of the temporary buffers it allocates (gathered weights, gradient
    communication buffers): allocations, live count and bytes, and the peak of live bytes. A released
    buffer's storage is resized to zero, so views autograd still holds (the forward leaves) keep no memory."""

    def __init__(self):
        self.allocations = {"weight": 0, "grad": 0}
        self.live = {"weight": 0, "grad": 0}
        self.live_bytes = {"weight": 0, "grad": 0}
        self.peak_bytes = {"weight": 0, "grad": 0}

    def allocate(self, kind: str, numel: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        buf = torch.empty(numel, dtype=dtype or like.dtype, device=like.device)
        self.allocations[kind] += 1
        self.live[kind] += 1
        self.live_bytes[kind] += buf.untyped_storage().nbytes()
        self.peak_bytes[kind] = max(self.peak_bytes[kind], self.live_bytes[kind])
        return buf

    def observe(self, kind: str, extra_bytes: int) -> None:
        """Count ``extra_bytes`` held beside the live buffers in the peak (autograd's full gradients)."""
        self.peak_bytes[kind] = max(self.peak_bytes[kind], self.live_bytes[kind] + extra_bytes)

    def release(self, kind: str, buf: torch.Tensor | None) -> None:
        if buf is not None and buf.untyped_storage().nbytes():
            self.live[kind] -= 1
            self.live_bytes[kind] -= buf.untyped_storage().nbytes()
            buf.untyped_storage().resize_(0)


class Unit:
    """A group of modules communicated together: its (module, attribute, parameter) entries, their shards,
    and the gathered state of the current step."""

    def __init__(self, index: int, modules: list[nn.Module], comm: Comm, owned=lambda param: True, users=()):
        self.index, self.modules, self.comm = index, modules, comm  # ``comm``: the dimension it is sharded over
        self.entries = [(*_owner(m, name), p) for m in modules for name, p in m.named_parameters()
                        if p.requires_grad and owned(p)]
        # modules outside the unit holding one of its parameters (a tied head): (module, attribute, entry index)
        self.aliases = [(module, attr, [id(p) for _, _, p in self.entries].index(id(param)))
                        for module, attr, param in users if param.requires_grad]
        self.shapes = [p.shape for _, _, p in self.entries]
        self.shard: torch.Tensor | None = None       # flat local shard (params' .data are views)
        self.grad: torch.Tensor | None = None        # flat local gradient shard (params' .grad are views);
                                                      # None from zero_grad until the first reduce-scatter
        self.pending = None                           # in-flight all-gather
        self.gather_source = None                     # what it reads (the shard cast to the compute dtype)
        self.gathered: torch.Tensor | None = None     # the all-gather destination
        self.full: list[torch.Tensor] | None = None   # full parameters (views into one storage)
        self.full_storage: torch.Tensor | None = None
        self.leaves: list[torch.Tensor] | None = None
        self.accumulated = 0
        self.saves_weights = False                    # some saved tensor of its forward is a weight
        self.grads_prepared = False
        self.main_grad: torch.Tensor | None = None    # mixed precision: the fp32 sum of the step's gradients
        self.flat_param: nn.Parameter | None = None   # the optimizer's flat shard (buffer-reuse layout)
        self.late_prefetch = False                    # backward prefetch at after_last_child_backward
        self.norm_keys: set = set()                   # the gradient norm's groups (mesh dimensions)
        self.norm_pieces: list = []                   # runs of ``grad`` by group (:func:`norm_pieces`)


def _owner(module: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    *path, name = qualified.split(".")
    for part in path:
        module = getattr(module, part)
    return module, name


def unit_offsets(unit: Unit) -> list[int]:
    """Start of each parameter's rows inside the unit's flat shard."""
    offsets, offset = [], 0
    for _, _, p in unit.entries:
        offsets.append(offset)
        offset += p.numel()
    return offsets


def copy_rows(ranks: torch.Tensor, flat: torch.Tensor, into_ranks: bool, add: bool = False) -> None:
    """Move between a [N, chunk] rank-major block and a flat tensor holding its first ``flat.numel()``
    elements in order (the rest of the block is padding, zeroed when writing into the block; ``add``: added
    into the block instead, whose padding stays as it is)."""
    chunk = ranks.shape[1]
    whole, rest = divmod(flat.numel(), chunk)
    if into_ranks and add:
        ranks[:whole].add_(flat[:whole * chunk].view(whole, chunk))
        if rest:
            ranks[whole, :rest].add_(flat[whole * chunk:])
    elif into_ranks:
        ranks[:whole].copy_(flat[:whole * chunk].view(whole, chunk))
        if whole < ranks.shape[0]:
            ranks[whole, :rest].copy_(flat[whole * chunk:])
            ranks[whole, rest:].zero_()
            ranks[whole + 1:].zero_()
    else:
        flat[:whole * chunk].view(whole, chunk).copy_(ranks[:whole])
        if rest:
            flat[whole * chunk:].copy_(ranks[whole, :rest])
