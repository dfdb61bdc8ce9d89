"""Cutting the layers into pipeline stages: equal layer counts, or balanced by measured runtime.

A synchronous pipeline runs at the pace of its slowest stage (the straggler), so stages should be balanced
by measured time, not by layer count: the embedding sits with the first stage and the norm, the head and
the loss with the last, and a large vocabulary makes the last stage slow. :func:`profile_costs` times the
forward and backward of every part of the model on a microbatch; :func:`balanced_bounds` then finds the
contiguous split minimising the slowest stage (exact, by dynamic programming over cut points), the
criterion of PipeDream's partitioner (Narayanan et al., SOSP 2019) without its communication terms.
"""

from __future__ import annotations

import statistics
import time

from parallelisms.config import ModelConfig
from parallelisms.errors import ConfigError


def equal_bounds(n_layers: int, stages: int) -> list[int]:
    """Stage ``s`` holds layers ``bounds[s] .. bounds[s+1]-1``; the first ``n % stages`` stages get one more."""
    if n_layers < stages:
        raise ConfigError(f"{n_layers} layers cannot fill {stages} pipeline stages (pp x chunks); "
                          f"use a model with at least {stages} layers or fewer stages")
    base, extra = divmod(n_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return bounds


def stage_costs(bounds: list[int], layer_costs: list[float], first_cost: float, last_cost: float) -> list[float]:
    """Per-stage time: its layers, plus the embedding on stage 0 and the head and loss on the last."""
    costs = [sum(layer_costs[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)]
    costs[0] += first_cost
    costs[-1] += last_cost
    return costs


def balanced_bounds(layer_costs: list[float], first_cost: float, last_cost: float, stages: int) -> list[int]:
    """Contiguous bounds (each stage at least one layer) minimising the slowest stage's cost."""
    n = len(layer_costs)
    if n < stages:
        equal_bounds(n, stages)  # raises the one-line error
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, a: int, b: int) -> float:  # stage s holds layers a..b-1
        return prefix[b] - prefix[a] + (first_cost if s == 0 else 0.0) + (last_cost if s == stages - 1 else 0.0)

    # best[s][b]: the smallest possible slowest-stage cost of stages 0..s-1 covering layers 0..b-1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for b in range(s, n - (stages - s) + 1):
            for a in range(s - 1, b):
                value = max(best[s - 1][a], cost(s - 1, a, b))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    bounds, b = [n], n
    for s in range(stages, 0, -1):
        b = cut[s][b]
        bounds.append(b)
    return bounds[::-1]


def profile_costs(cfg: ModelConfig, rows: int, seq_len: int, repeats: int = 5, seed: int = 0
                  ) -> tuple[list[float], float, float]:
    """Measured forward + backward seconds of each block, of the embedding, and of norm + head + loss,
    on one microbatch of ``rows`` x ``seq_len`` tokens (medians over ``repeats``; one warm-up)."""
    import torch  # the cut itself is torch-free: ``plan`` and ``estimate`` price the runtime's stages with it

    from parallelisms.model import build_model

    model = build_model(cfg, seed)
    tokens = torch.randint(0, cfg.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(seed))
    cos, sin = model.rope_cos[:seq_len], model.rope_sin[:seq_len]
    hidden = torch.randn(rows, seq_len, cfg.dim, generator=torch.Generator().manual_seed(seed))

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def run(part):
        def fn():
            x = hidden.clone().requires_grad_()
            part(x).float().sum().backward()
        return fn

    layers = [timed(run(lambda x, layer=layer: layer(x, cos, sin))) for layer in model.layers.values()]
    first = timed(lambda: model.tok_embeddings(tokens).sum().backward())
    last = timed(run(lambda x: model.loss(model.output(model.norm(x)), tokens)))
    return layers, first, last
