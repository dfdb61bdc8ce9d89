"""Context parallelism priced from its modes' descriptors (:mod:`parallelisms.parallel.cp_modes`): the traffic a
cp rank makes per layer, its exposed time (ring hops behind the attention of the blocks they carry, the other
collectives blocking) and the calls it meets its peers in. ``perf.model`` sums the volumes per step,
``perf.step`` adds the times and the calls.
"""

from __future__ import annotations

from typing import Callable

from parallelisms.comm.ledger import ring_bytes_per_rank
from parallelisms.config import ModelConfig, ParallelConfig
from parallelisms.parallel.cp_modes import MODES, ContextMode, Shape
from parallelisms.perf.hardware import Hardware
from parallelisms.perf.network import collective_time


def _mode(cfg: ModelConfig, parallel: ParallelConfig, element_bytes: int = 4) -> tuple[ContextMode, Shape]:
    """The layout's mode and its degrees (the traffic does not depend on the sequence length: 0); the ring's
    dK and dV travel in fp32 at least (``parallel/context.py``'s accumulators)."""
    dims = parallel.dims
    return MODES[parallel.cp_attention], Shape(dims.cp, parallel.cp_ulysses_size, cfg.n_heads // dims.tp,
                                               max(1, cfg.n_kv_heads // dims.tp), 0, max(1.0, 4 / element_bytes),
                                               parallel.recompute)


def context_volumes(cfg: ModelConfig, parallel: ParallelConfig, q_bytes: float, kv_bytes: float,
                    element_bytes: int = 4) -> list[tuple[str, str, float]]:
    """(kind, group, bytes this rank sends) per layer, forward, backward and a recomputed forward together, for
    ``q_bytes`` of local queries and ``kv_bytes`` of local K (or V) in elements of ``element_bytes``."""
    mode, shape = _mode(cfg, parallel, element_bytes)
    groups = mode.groups(shape)
    return [(t.kind, t.dim, ring_bytes_per_rank(t.kind, t.total, groups[t.dim][0]))
            for t in mode.traffic(shape, q_bytes, kv_bytes)]


def context_calls(cfg: ModelConfig, parallel: ParallelConfig) -> tuple[int, int]:
    """Collectives (a ring hop's sends and receives together: one) per layer, forward and backward."""
    mode, shape = _mode(cfg, parallel)
    traffic = mode.traffic(shape, 1.0, 1.0)
    return sum(t.calls[0] for t in traffic), sum(t.calls[1] for t in traffic)


def context_times(hw: Hardware, cfg: ModelConfig, parallel: ParallelConfig, q_bytes: float, kv_bytes: float,
                  attention_core: float, behind: Callable, element_bytes: int = 4) -> dict[str, tuple[float, float]]:
    """Exposed (forward, backward) seconds per layer of each exchange, named ``kind/group``. A ring's hop h
    runs under the attention of block h (forward: K and V; backward: K, V, dK and dV, the gradients in fp32 at
    least); the first is exposed; ``behind(hw, seconds, window)``: the exposed part of a collective under compute."""
    mode, shape = _mode(cfg, parallel, element_bytes)
    groups = mode.groups(shape)
    out = {}
    for t in mode.traffic(shape, q_bytes, kv_bytes):
        n, stride = groups[t.dim]
        stride *= parallel.dims.span("cp")[1]  # the mode's stride among cp ranks, the mesh's between them

        def time(kind: str, full_bytes: float, calls: int) -> float:
            return collective_time(hw, kind, full_bytes, n, stride, calls)
        if t.hidden:
            hop_f = time(t.kind, t.forward / t.calls[0], 1)
            hop_b = time(t.kind, (1 + shape.grad_bytes) * t.forward / t.calls[0], 1)
            forward = hop_f + (t.calls[0] - 1) * behind(hw, hop_f, attention_core / n)
            backward = hop_b + (t.calls[1] - 1) * behind(hw, hop_b, 2.5 * attention_core / n)
        else:
            forward = time(t.kind, t.forward, t.calls[0])
            backward = time(t.kind, t.backward, t.calls[1])
        out[f"{t.kind}/{t.dim}"] = (forward, backward)
    return out
