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


def shared_link(traffic, m: int, t_f: float, t_bw: float, behind, units: list | None = None, depth: int = 1) -> dict:
    """Exposed seconds of a fully sharded engine's parameter gathers and gradient reduce-scatters (one group, one
    link): each pass's collectives run back to back on the link under that pass's compute, so a pass exposes
    what their sum outlasts it by (not each alone), or, where more, what its gathers stall it unit by unit at
    the prefetch ``depth`` (:func:`exposed_gathers`; ``units``: (parameters, forward s, backward s) of each
    wrapped unit in order; without them, one unit's gather a microbatch), split between them by their seconds; each microbatch's
    last reduce-scatter bucket stays exposed. ``traffic``: (name, role, seconds, calls) of the step's
    data-parallel collectives, ``m`` microbatches of ``t_f`` forward and ``t_bw`` backward seconds, ``behind(t,
    window)`` a collective's exposed seconds under a window of compute. {} where there are no such gathers."""
    gathers = [(name, t, calls) for name, role, t, calls in traffic if role == "gather"]
    scatters = [(name, t, calls) for name, role, t, calls in traffic
                if role in ("reduce", "reduce_each") and name.startswith("reduce_scatter/")]
    if not gathers:
        return {}
    gather_s = sum(t for _, t, _ in gathers) / 2 / m  # one pass of one microbatch
    stalls = [m * sum(t / calls for _, t, calls in gathers)] * 2
    if units:
        params = sum(p for p, _, _ in units)
        share = [gather_s * p / params for p, _, _ in units]
        stalls = [m * exposed_gathers(share, [f for _, f, _ in units], depth),
                  m * exposed_gathers(share[::-1], [b for _, _, b in units][::-1], depth)]
    forward = {name: t / 2 for name, t, _ in gathers}  # the flat engine gathers each unit for both passes
    backward = {**forward, **{name: t for name, t, _ in scatters}}
    out = {}
    for load, window, stall in ((forward, m * t_f, stalls[0]), (backward, m * t_bw, stalls[1])):
        total = sum(load.values())
        exposed = max(behind(total, window), stall)
        for name, t in load.items():
            out[name] = out.get(name, 0.0) + exposed * t / total
    for name, t, calls in scatters:
        out[name] += m * t / calls  # each microbatch's last bucket
    return out
