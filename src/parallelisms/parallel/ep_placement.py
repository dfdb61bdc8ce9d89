"""Where experts sit on expert-parallel ranks under ``--ep-balance measured``: a placement by measured load, as
DeepSeek's expert-parallel load balancer (EPLB, DeepSeek-V3 2024) computes it.

A placement of one MoE layer is a list of ``ranks x slots`` logical experts: physical slot ``p`` (rank
``p // slots``, its slot ``p % slots``) holds a copy of expert ``placement[p]``. Each rank has ``n_experts / ranks
+ redundant`` slots, so the ``ranks x redundant`` extra slots hold second (third...) copies of the hottest experts.
Two steps, both EPLB's: :func:`replicate` gives each extra slot to the expert with the largest load per copy
(a copy takes an equal share of its expert's tokens), then :func:`pack` puts the copies heaviest first on the
least-loaded rank that has a free slot and no copy of that expert yet (two copies on one rank would split nothing).
Should the greedy packing corner itself (no rank left that may take a copy), :func:`round_robin` places the
copies column by column, which never puts two copies of an expert on one rank. Pure functions of the loads: every
rank computes the same placement from the same all-reduced counts.
"""

from __future__ import annotations

from collections import Counter


def replicate(loads: list[float], ranks: int, extra: int) -> list[int]:
    """Copies of each expert: one each, then ``extra`` more, each to the expert with the largest load per copy
    (ties: the lower expert), at most ``ranks`` copies of one expert."""
    copies = [1] * len(loads)
    for _ in range(extra):
        candidates = [e for e in range(len(loads)) if copies[e] < ranks]
        hottest = max(candidates, key=lambda e: (loads[e] / copies[e], -e))
        copies[hottest] += 1
    return copies


def round_robin(copies: list[int], ranks: int) -> list[list[int]]:
    """The copies grouped by expert, dealt to ranks in turn: consecutive copies of one expert (at most ``ranks``)
    land on distinct ranks, and every rank gets the same number of slots."""
    held: list[list[int]] = [[] for _ in range(ranks)]
    for i, e in enumerate(e for e, c in enumerate(copies) for _ in range(c)):
        held[i % ranks].append(e)
    return held


def pack(loads: list[float], copies: list[int], ranks: int) -> list[list[int]]:
    """The experts each rank holds (``sum(copies) / ranks`` each): copies heaviest first, each to the least
    loaded rank with a free slot that holds no copy of its expert (ties: fewer slots used, then the lower rank)."""
    slots = sum(copies) // ranks
    items = sorted(((loads[e] / copies[e], e) for e in range(len(loads)) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    held: list[list[int]] = [[] for _ in range(ranks)]
    load = [0.0] * ranks
    for weight, e in items:
        fit = [r for r in range(ranks) if len(held[r]) < slots and e not in held[r]]
        if not fit:
            return round_robin(copies, ranks)
        r = min(fit, key=lambda r: (load[r], len(held[r]), r))
        held[r].append(e)
        load[r] += weight
    return held


def place(loads: list[float], ranks: int, redundant: int) -> list[int]:
    """One layer's placement (physical slot -> logical expert, rank-major, each rank's experts ascending) for
    the tokens ``loads[e]`` routed to each expert, over ``ranks`` ranks with ``redundant`` extra slots each."""
    copies = replicate([float(x) for x in loads], ranks, ranks * redundant)
    return [e for experts in pack([float(x) for x in loads], copies, ranks) for e in sorted(experts)]


def canonical(n_experts: int, ranks: int, redundant: int) -> list[int]:
    """The placement before any measurement: plain expert parallelism's (rank r owns the r-th run of
    ``n_experts / ranks`` experts), each rank's extra slots holding copies of the experts that follow its own."""
    own = n_experts // ranks
    return [e for r in range(ranks) for e in sorted(list(range(r * own, (r + 1) * own))
                                                    + [((r + 1) * own + j) % n_experts for j in range(redundant)])]


def slots_per_rank(placement: list[int], ranks: int) -> int:
    """Slots each of ``ranks`` ranks holds under ``placement``: what the dispatch splits by."""
    return len(placement) // ranks


def replicated(placement: list[int], n_experts: int) -> list[int]:
    """The experts with more than one copy under ``placement``, ascending: those whose copies' gradients are
    summed after each reduction."""
    copies = Counter(placement)
    return [e for e in range(n_experts) if copies[e] > 1]


def rank_loads(loads: list[float], placement: list[int], ranks: int) -> list[float]:
    """The tokens each rank's experts receive under ``placement`` (a copy takes an equal share of its expert's)."""
    copies = [placement.count(e) for e in range(len(loads))]
    slots = len(placement) // ranks
    return [sum(loads[e] / copies[e] for e in placement[r * slots:(r + 1) * slots]) for r in range(ranks)]


def max_redundant(n_experts: int, ranks: int) -> int:
    """The most extra slots per rank: every expert on every rank (``ranks - 1`` more copies of each)."""
    return n_experts // ranks * (ranks - 1)


def valid(placement, n_experts: int, ranks: int, length: int) -> bool:
    """Whether ``placement`` (say, from a checkpoint) fits: ``length`` slots over ``ranks``, every expert held,
    no two copies of one expert on one rank."""
    if not isinstance(placement, list) or len(placement) != length or length % ranks:
        return False
    if not all(isinstance(e, int) and 0 <= e < n_experts for e in placement) or len(set(placement)) != n_experts:
        return False
    slots = length // ranks
    return all(len(set(placement[r * slots:(r + 1) * slots])) == slots for r in range(ranks))


def check_ep_balance(parallel, model) -> None:
    """--ep-balance measured: expert parallelism over DDP or any sharding engine (its slots' elements in the
    engine's shards, :mod:`parallelisms.parallel.ep_slots`), fp32 or bf16, with or without a pipeline (DualPipe's
    two copies of a stage placed alike; PipeDream's per-microbatch updates sum an expert's copies and count it once
    in the stage's norm), and a redundant count the experts can fill."""
    from parallelisms.errors import require
    from parallelisms.options import Balance, choices

    dims = parallel.dims
    require(isinstance(parallel.ep_balance, Balance),  # the config made a valid string its member
            f"unknown --ep-balance {parallel.ep_balance!r}; choose {choices(Balance)}")
    if parallel.ep_balance is not Balance.MEASURED:
        require(parallel.ep_redundant == 0 and parallel.ep_rebalance_every == 0,
                f"--ep-redundant {parallel.ep_redundant} / --ep-rebalance-every {parallel.ep_rebalance_every} apply "
                f"only with --ep-balance measured; add it or drop them")
        return
    require(model.n_experts > 0, "--ep-balance measured needs a mixture-of-experts model, but this one is dense; "
                                 "use --preset tiny-moe or a config with num_local_experts")
    require(dims.ep > 1, f"--ep-balance measured needs expert parallelism, got ep {dims.ep}; add --ep 2 or more")
    most = max_redundant(model.n_experts, dims.ep)
    require(0 <= parallel.ep_redundant <= most,
            f"--ep-redundant {parallel.ep_redundant} is beyond the experts: {model.n_experts} experts over ep "
            f"{dims.ep} give each rank {model.n_experts // dims.ep}, and a rank can take at most {most} more (a "
            f"copy of every other expert); use 0 to {most}")
