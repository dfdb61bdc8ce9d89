"""The context-parallel modes: the ways attention runs over a sequence sharded across the cp ranks, one
descriptor each, in a module without torch (the command line checks a layout and ``estimate`` prices it
before any process starts). The traffic is what the ledger of a real run counts: recomputed forwards' re-sends
and the K/V heads Ulysses repeats included, so ``perf/`` prices every mode through it alone.

A descriptor names the mode's attention core (``module:function``, imported when a model is built and called
once per layer as ``function(comms, held, inner, parallel)``, ``held`` every cp rank's positions, ``inner``
the model's own core), the sequence positions each cp rank holds
(zigzag chunk pairs for causal balance, Brandon et al. 2023, or contiguous chunks), its rules (one-line errors
before launch), the groups it talks over, its traffic per layer (what ``perf/`` prices and the ledger of a
real run counts) and what its core keeps for backward (what ``perf/memory.py`` prices).
A new mode is its core's module and one entry in :data:`MODES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from parallelisms.errors import divisors, require
from parallelisms.options import Recompute


@dataclass(frozen=True)
class Shape:
    """What a mode's rules read: the degrees, the heads one tensor-parallel rank holds and the sequence."""
    cp: int
    ulysses: int        # --cp-ulysses-size (hierarchical: the all-to-all degree inside a node; 0 unset)
    n_heads: int
    n_kv_heads: int
    seq_len: int
    grad_bytes: float = 1.0  # a dK or dV byte per K or V byte (the ring accumulates them in fp32 at least)
    recompute: str = Recompute.NONE  # --recompute: a recomputed forward sends its exchanges again in backward


@dataclass(frozen=True)
class Traffic:
    """One exchange a cp rank makes per layer and microbatch: its kind, its group (``cp`` or a sub-group), the
    full bytes of its calls forward and backward (what a send sends; a collective's whole tensor, as the
    ledger's numel counts it: the all-gather's output, the reduce-scatter's input), the calls each way, and
    whether it runs behind the attention of the blocks it carries (ring hops); ``recomputed``: the full bytes a
    recomputed forward sends again in backward (a volume: the step's time model prices recomputation itself)."""
    kind: str
    dim: str
    forward: float
    backward: float
    calls: tuple[int, int]
    hidden: bool = False
    recomputed: float = 0.0

    @property
    def total(self) -> float:
        """Full bytes per layer and microbatch, forward, backward and recomputation together."""
        return self.forward + self.backward + self.recomputed


def zigzag(s: Shape, rank: int) -> list[int]:
    """Chunks r and 2N-1-r of 2N: every rank the same unmasked causal work."""
    chunk = s.seq_len // (2 * s.cp)
    return [*range(rank * chunk, (rank + 1) * chunk), *range((2 * s.cp - 1 - rank) * chunk, (2 * s.cp - rank) * chunk)]


def contiguous(s: Shape, rank: int) -> list[int]:
    chunk = s.seq_len // s.cp
    return list(range(rank * chunk, (rank + 1) * chunk))


def whole_cp(s: Shape) -> dict[str, tuple[int, int]]:
    return {"cp": (s.cp, 1)}


def repeated_out(e: int, q: float, kv: float, heads: float, cp: int) -> float:
    """What a core over all-to-alls keeps a token (Ulysses, hierarchical): q, the key and value repeated to every
    query head, the output and the output as it comes back from the all-to-all (5 e q), and the log-sum-exp."""
    return 5 * e * q + 4 * heads


def unrepeated(e: int, q: float, kv: float, heads: float, cp: int) -> float:
    """Ring attention's per token: q, k, v and the output without repeating (e(2q + 2kv)), and the log-sum-exp."""
    return e * (2 * q + 2 * kv) + 4 * heads


def gathered(e: int, q: float, kv: float, heads: float, cp: int) -> float:
    """All-gather attention's per token: the whole sequence's repeated key and value (2 cp e q), q, each run's
    output and their concatenation ((3 + 2cp) e q), and the log-sum-exp."""
    return (3 + 2 * cp) * e * q + 4 * heads


def no_masks(seq: float, cp: int, e: int) -> float:
    """Nothing a layer beyond the per-token bytes: a core whose SDPA takes no mask tensor."""
    return 0.0


def all_gather_masks(seq: float, cp: int, e: int) -> float:
    """The causal masks all-gather attention's SDPA keeps a layer (``parallel/cp_allgather.py``: boolean, made
    into the query's dtype by SDPA) on the busiest cp rank, the middle one, whose two chunks of c = seq/2 local
    positions are one run of 2c queries over (cp + 1) c keys. The CUDA path passes torch's CausalBias to the
    fused kernel and keeps none."""
    c = seq / 2
    return 2 * c * (cp + 1) * c * e


@dataclass(frozen=True)
class ContextMode:
    name: str
    summary: str
    core: str                                   # "module:function" building one layer's attention core
    positions: Callable[[Shape, int], list[int]]  # the positions cp rank r holds
    check: Callable[[Shape], None]              # one-line ConfigErrors
    traffic: Callable[[Shape, float, float], list[Traffic]]  # (shape, local query bytes, local K (or V) bytes)
    groups: Callable[[Shape], dict[str, tuple[int, int]]] = whole_cp  # (ranks, stride in cp ranks) per group
    # what the core keeps for backward (``perf/memory.py`` prices it): bytes a token of a layer, from (activation
    # bytes e, query width q, key/value width kv, query heads, cp), each per tensor-parallel rank; and bytes a layer
    # and microbatch beyond them, from (local positions, cp, e)
    kept: Callable[[int, float, float, float, int], float] = repeated_out
    kept_per_layer: Callable[[float, int, int], float] = no_masks


def _zigzag_chunks(s: Shape, what: str) -> None:
    require(s.seq_len % (2 * s.cp) == 0, f"{what} with --cp {s.cp} cuts the sequence into 2 x cp = {2 * s.cp} "
                                         f"zigzag chunks, but --seq-len {s.seq_len} is not divisible by {2 * s.cp}")


def _heads_fit(s: Shape, degree: int, flag: str) -> None:
    """Ulysses over ``degree`` ranks: query heads it divides, KV heads it divides or repeats to."""
    def fits(d: int) -> bool:
        return s.n_heads % d == 0 and (s.n_kv_heads % d == 0 or d % s.n_kv_heads == 0)
    require(fits(degree), lambda: f"Ulysses {flag} {degree} gives each rank heads/{degree} query heads and needs "
                                  f"n_kv_heads a multiple or a divisor of it, but n_heads {s.n_heads} and n_kv_heads "
                                  f"{s.n_kv_heads} do not fit {degree} (per tensor-parallel rank); use --cp-attention "
                                  f"ring or {flag} in {list(filter(fits, divisors(s.n_heads)))}")


def _ring_hops(s: Shape, dim: str, n: int, kv: float) -> Traffic:
    """K and V forward N-1 hops; K and V again and dK, dV (``grad_bytes`` a K byte) N hops (one further, home)
    backward; a recomputed forward (full, or selective: the core) sends K and V its N-1 hops again."""
    forward = 2 * (n - 1) * kv
    return Traffic("send", dim, forward, forward + 2 * n * kv * s.grad_bytes, (n - 1, n), hidden=True,
                   recomputed=forward if s.recompute != Recompute.NONE else 0.0)


def _repeated(s: Shape, degree: int, kv: float) -> float:
    """K (or V) bytes once Ulysses over ``degree`` ranks repeats the KV heads up to ``degree`` where fewer, so
    that each rank receives the head its query heads share (as DeepSpeed-Ulysses does for GQA)."""
    return kv * max(s.n_kv_heads, degree) / s.n_kv_heads


def _all_to_alls(s: Shape, dim: str, n: int, q: float, kv: float) -> Traffic:
    """q, k, v (KV heads repeated: ``kv`` already is) to head shards and the output back, forward and backward;
    a recomputed forward repeats them (selective: the inputs only, torch's checkpoint stops once the core's kept
    tensors are recomputed)."""
    forward = 2 * q + 2 * kv
    return Traffic("all_to_all", dim, forward, forward, (4, 4),
                   recomputed={"full": forward, "selective": q + 2 * kv}.get(s.recompute, 0.0))


def _check_ring(s: Shape) -> None:
    _zigzag_chunks(s, "ring attention")


def _check_ulysses(s: Shape) -> None:
    require(s.seq_len % s.cp == 0, f"--seq-len {s.seq_len} must be divisible by --cp {s.cp}")
    _heads_fit(s, s.cp, "--cp")


def _check_all_gather(s: Shape) -> None:
    _zigzag_chunks(s, "all-gather attention")


def _all_gather_traffic(s: Shape, q: float, kv: float) -> list[Traffic]:
    """K and V (stacked) all-gathered forward (again by a recomputed forward: the gather is in the core);
    dK and dV reduce-scattered backward."""
    gathered = 2 * s.cp * kv
    return [Traffic("all_gather", "cp", gathered, 0.0, (1, 0), recomputed=gathered if s.recompute != Recompute.NONE else 0.0),
            Traffic("reduce_scatter", "cp", 0.0, gathered, (0, 1))]


def _check_hierarchical(s: Shape) -> None:
    u = s.ulysses
    require(1 < u < s.cp and s.cp % u == 0, f"hierarchical context parallelism splits --cp {s.cp} into Ulysses "
                                            f"inside x ring across; --cp-ulysses-size {u} must divide it, between "
                                            f"2 and {s.cp // 2}: one of {[d for d in divisors(s.cp) if 1 < d < s.cp]}")
    _zigzag_chunks(s, "hierarchical context parallelism")
    _heads_fit(s, u, "--cp-ulysses-size")


def _hierarchical_positions(s: Shape, rank: int) -> list[int]:
    """Outer ring rank o holds zigzag chunks o and 2r-1-o of 2r; its u inner ranks hold a u-th of each, so that
    Ulysses' all-to-all hands each inner rank the group's whole zigzag pair (for heads/u)."""
    u, (outer, inner) = s.ulysses, divmod(rank, s.ulysses)
    pair = zigzag(Shape(s.cp // u, 0, s.n_heads, s.n_kv_heads, s.seq_len), outer)
    half, piece = len(pair) // 2, len(pair) // (2 * u)
    return [*pair[inner * piece:(inner + 1) * piece], *pair[half + inner * piece:half + (inner + 1) * piece]]


def _hierarchical_groups(s: Shape) -> dict[str, tuple[int, int]]:
    return {"cp_inner": (s.ulysses, 1), "cp_outer": (s.cp // s.ulysses, s.ulysses)}


def _hierarchical_traffic(s: Shape, q: float, kv: float) -> list[Traffic]:
    """Ulysses' all-to-alls inside; the ring across carries K/V blocks of heads/u over u x the tokens: the
    same bytes as the rank's own K/V, once repeated for the all-to-all."""
    kv = _repeated(s, s.ulysses, kv)
    return [_all_to_alls(s, "cp_inner", s.ulysses, q, kv), _ring_hops(s, "cp_outer", s.cp // s.ulysses, kv)]


_CORES = "parallelisms.parallel.context"
MODES: dict[str, ContextMode] = {m.name: m for m in (
    ContextMode("ring", "ring attention, zigzag shards (default)", f"{_CORES}:ring_core", zigzag, _check_ring,
                lambda s, q, kv: [_ring_hops(s, "cp", s.cp, kv)], kept=unrepeated),
    ContextMode("ulysses", "all-to-all over heads", f"{_CORES}:ulysses_core", contiguous, _check_ulysses,
                lambda s, q, kv: [_all_to_alls(s, "cp", s.cp, q, _repeated(s, s.cp, kv))]),
    ContextMode("allgather", "K/V all-gathered, queries local (Llama 3)",
                "parallelisms.parallel.cp_allgather:all_gather_core", zigzag, _check_all_gather, _all_gather_traffic,
                kept=gathered, kept_per_layer=all_gather_masks),
    ContextMode("hierarchical", "Ulysses inside --cp-ulysses-size ranks, ring across (USP)",
                "parallelisms.parallel.cp_hierarchical:hierarchical_core", _hierarchical_positions,
                _check_hierarchical, _hierarchical_traffic, _hierarchical_groups),
)}


def mode(name: str) -> ContextMode:
    require(name in MODES, f"unknown --cp-attention {name!r}; choose {', '.join(MODES)}")
    return MODES[name]
