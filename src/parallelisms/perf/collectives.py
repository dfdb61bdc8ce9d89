"""The Hockney (alpha-beta) model of a collective: T(m) = alpha + beta * m (Hockney 1994).

``alpha`` is the fixed latency per call, ``beta`` the time per byte a rank sends (the inverse of the
bandwidth seen by the ring algorithm), ``m`` the logical bytes per rank from the ledger's ring formulas.
K separate collectives of M bytes in total cost about K alpha + beta M; fused into one bucket,
alpha + beta M (spec: "Gradient bucketing"). ``fit`` recovers alpha and beta from measured times.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallelisms.comm.ledger import ring_bytes_per_rank


@dataclass(frozen=True)
class AlphaBeta:
    alpha_s: float          # seconds per call
    beta_s_per_byte: float  # seconds per byte sent by one rank

    def time(self, bytes_per_rank: float, calls: int = 1) -> float:
        """Predicted seconds for ``calls`` collectives sending ``bytes_per_rank`` in total."""
        return calls * self.alpha_s + self.beta_s_per_byte * bytes_per_rank

    def collective_time(self, kind: str, tensor_bytes: float, group_size: int, calls: int = 1) -> float:
        """Predicted seconds for ``calls`` collectives of ``kind`` over tensors totalling ``tensor_bytes``."""
        return self.time(ring_bytes_per_rank(kind, tensor_bytes, group_size), calls)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte


def fit(bytes_per_rank: list[float], seconds: list[float], relative: bool = True) -> tuple[AlphaBeta, float]:
    """Least-squares alpha and beta from (bytes per rank, seconds) pairs, and the R^2 of the fit.

    ``relative`` weighs each point by 1/t^2 (minimising relative error), so the small messages that
    determine alpha count as much as the large ones that determine beta.
    """
    n = len(bytes_per_rank)
    if n < 2 or len(seconds) != n:
        raise ValueError(f"need at least two (bytes, seconds) pairs of equal count, got {n} and {len(seconds)}")
    if len(set(bytes_per_rank)) < 2:
        raise ValueError("message sizes must differ to separate latency from bandwidth")
    w = [1.0 / t**2 if relative else 1.0 for t in seconds]
    sw = sum(w)
    mean_m = sum(wi * m for wi, m in zip(w, bytes_per_rank)) / sw
    mean_t = sum(wi * t for wi, t in zip(w, seconds)) / sw
    var_m = sum(wi * (m - mean_m) ** 2 for wi, m in zip(w, bytes_per_rank))
    beta = sum(wi * (m - mean_m) * (t - mean_t) for wi, m, t in zip(w, bytes_per_rank, seconds)) / var_m
    alpha = mean_t - beta * mean_m
    residual = sum(wi * (t - alpha - beta * m) ** 2 for wi, m, t in zip(w, bytes_per_rank, seconds))
    total = sum(wi * (t - mean_t) ** 2 for wi, t in zip(w, seconds))
    return AlphaBeta(alpha, beta), 1.0 - residual / total if total > 0 else 1.0
