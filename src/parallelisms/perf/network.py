"""Time of one collective on a group placed in the mesh: alpha-beta (Hockney 1994) per algorithm, the
NCCL bus-bandwidth factors (nccl-tests PERFORMANCE.md: all-reduce 2(n-1)/n; all-gather, reduce-scatter,
all-to-all (n-1)/n), and hierarchical when the group spans nodes.

Ranks are laid out ``pp, dp_replicate, dp_shard, cp, tp`` outermost to innermost (mesh.py), so a group of
``n`` ranks ``stride`` apart has ``gpus_per_node // stride`` members on each node: tensor-parallel groups
stay on NVLink, pipeline stages cross nodes first. A group spanning nodes runs the collective inside each
node on the whole tensor and across nodes on 1/n_in of it (NCCL's tree/ring hierarchy; the inter-node link
is each GPU's own NIC). Ring algorithms pay n-1 (all-reduce 2(n-1)) latencies per call; for small messages
the tree (all-reduce) or recursive doubling/halving (all-gather, reduce-scatter) pay log2 n: the faster is
taken. A kind measured by ``parallelisms calibrate`` uses its fitted alpha and beta instead.
"""

from __future__ import annotations

import math

from parallelisms.comm.ledger import ring_bytes_per_rank
from parallelisms.perf.hardware import Hardware


def _steps(kind: str, n: int) -> tuple[int, int]:
    """Latency terms per call of (ring or pairwise, tree or recursive) algorithms."""
    log = math.ceil(math.log2(n)) if n > 1 else 0
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * log
    if kind in ("all_gather", "reduce_scatter"):
        return n - 1, log
    if kind == "all_to_all":
        return n - 1, n - 1
    return 1, 1  # send, broadcast


def _flat(kind: str, full_bytes: float, n: int, alpha: float, bandwidth: float) -> float:
    if n <= 1:
        return 0.0
    ring_steps, log_steps = _steps(kind, n)
    data = ring_bytes_per_rank(kind, full_bytes, n) / bandwidth
    ring = ring_steps * alpha + data
    if kind == "all_reduce":  # double binary tree: log latency, the whole tensor each way
        return min(ring, log_steps * alpha + 2 * full_bytes / bandwidth)
    return min(ring, log_steps * alpha + data)


def collective_time(hw: Hardware, kind: str, full_bytes: float, n: int, stride: int = 1, calls: int = 1) -> float:
    """Seconds for ``calls`` collectives of ``kind`` over tensors totalling ``full_bytes`` on ``n`` ranks
    ``stride`` apart (``send``: ``full_bytes`` to a rank ``stride`` away)."""
    if n <= 1 and kind != "send" or full_bytes <= 0 or calls <= 0:
        return 0.0
    if kind in hw.collectives:
        fit = hw.collectives[kind]
        return calls * fit["alpha_us"] * 1e-6 + ring_bytes_per_rank(kind, full_bytes, max(n, 2)) / (fit["gbps"] * 1e9)
    per_call = full_bytes / calls
    if kind == "send":
        alpha, bandwidth = hw.link(stride >= hw.gpus_per_node)
        return calls * (alpha + per_call / bandwidth)
    n_in = max(1, min(n, hw.gpus_per_node // stride)) if stride < hw.gpus_per_node else 1
    n_out = max(1, n // n_in)
    (a_in, b_in), (a_out, b_out) = hw.link(False), hw.link(True)
    if kind == "all_to_all" and n_out > 1:  # (n - n_in)/n of every rank's data leaves the node
        return calls * ((n - 1) * a_out + per_call * (n - n_in) / n / b_out)
    return calls * (_flat(kind, per_call, n_in, a_in, b_in) + _flat(kind, per_call / n_in, n_out, a_out, b_out))


def group(parallel, dim: str) -> tuple[int, int]:
    """(ranks, stride) of a mesh dimension's group in ``parallel`` (a ParallelConfig): the mesh's own plan,
    :meth:`ParallelDims.span <parallelisms.mesh.ParallelDims.span>`; the step model's ``dp`` is every rank that saw
    different tokens, the mesh's ``dp_cp``."""
    return parallel.dims.span("dp_cp" if dim == "dp" else dim)


def comm_time(hw: Hardware, parallel, kind: str, dim: str, full_bytes: float, calls: int = 1) -> float:
    """:func:`collective_time` over the group of mesh dimension ``dim``."""
    n, stride = group(parallel, dim)
    return collective_time(hw, kind, full_bytes, n, stride, calls)
