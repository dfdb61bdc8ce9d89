"""A fully sharded engine's parameter gathers under one pass, unit by unit, at a prefetch depth (``--fsdp-prefetch``,
PyTorch FSDP's forward/backward prefetch, as the flat engine runs it: :mod:`parallelisms.parallel.flat`).

The first unit's gather is waited for; as unit i starts computing, the gathers of units i+1 .. i+d are launched
(those not yet launched), and one link serves them in order. With gathers g_i and compute c_i:

    launch_i = start_{max(0, i - d)},  gather_end_i = max(launch_i, gather_end_{i-1}) + g_i,
    start_i = max(end_{i-1}, gather_end_i),  end_i = start_i + c_i,

and the pass exposes end_last - sum(c). Depth 1 hides each gather behind the one unit before it; a unit whose
gather outlasts that unit (a vocabulary-sized head after a block) stalls, which a deeper prefetch hides behind
more units, at the memory of d - 1 more gathered units. Where the gathers outlast the compute altogether, no
depth helps (the link is the bound).
"""

from __future__ import annotations


def exposed_gathers(gathers: list[float], compute: list[float], depth: int = 1) -> float:
    """Seconds a pass over units with these gather and compute seconds runs beyond its compute."""
    starts: list[float] = []
    gather_end = end = 0.0
    for i, (g, c) in enumerate(zip(gathers, compute)):
        launch = starts[max(0, i - depth)] if i else 0.0
        gather_end = max(launch, gather_end) + g
        start = max(end, gather_end)
        starts.append(start)
        end = start + c
    return end - sum(compute)
