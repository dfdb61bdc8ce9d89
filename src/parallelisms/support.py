"""Which layouts can run: every cross-check of a layout against the model and the training settings, run
before any process starts (one-line :class:`ConfigError` each: the constraint, the values, what would work).

This module sits above the parallelisms (it reads their descriptors, :mod:`parallelisms.parallel.registry`: the
features each switches on, the pairs each excludes, the rules each checks) and below the training loop and the
CLI, which call :func:`validate_layout`.
"""

from __future__ import annotations

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.errors import require
from parallelisms.parallel.registry import PARALLELISMS, ROWS, check_values

# -- the support table ---------------------------------------------------------------------------------------
# Features a layout can switch on, as `features()` names them, with the flag a user writes for each: every
# parallelism's (parallelisms.parallel.registry), in the registry's order.
FLAGS = {name: f.flag for p in PARALLELISMS.values() for name, f in p.features.items()}

# Every pair of features that cannot run together, with the reason: the pairs each parallelism's descriptor
# excludes. Any pair not listed works (each tested or verified; see README's feature table). Validation reads
# this table before any per-value check.
UNSUPPORTED: dict[frozenset, str] = {pair: why for p in PARALLELISMS.values() for pair, why in p.excludes.items()}


def features(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig) -> list[str]:
    """The features this layout switches on, by the support table's names."""
    return [name for p in PARALLELISMS.values() for name in p.switched(model, train, parallel)]


def check_pairs(feats: list[str]) -> None:
    """One line for the first pair of ``feats`` the support table says cannot run together."""
    for i, a in enumerate(feats):
        for b in feats[i + 1:]:
            reason = UNSUPPORTED.get(frozenset((a, b)))
            require(reason is None, f"{FLAGS.get(a, a)} with {FLAGS.get(b, b)}: {reason}")


def not_supported_markdown() -> str:
    """The README's list of pairs that do not run, generated from the table (a test keeps them equal)."""
    by_reason: dict[str, list[str]] = {}
    for pair, reason in UNSUPPORTED.items():
        a, b = sorted(pair, key=list(FLAGS).index)
        by_reason.setdefault(reason, []).append(f"`{FLAGS[a]}` with `{FLAGS[b]}`")
    return "\n".join(f"- {', '.join(pairs)}: {reason}." for reason, pairs in by_reason.items())


def feature_rows_markdown() -> str:
    """The README feature table's rows of the parallelisms, one per descriptor in the registry's order (its
    :data:`~parallelisms.parallel.registry.ROWS` entry); a test keeps README's first rows equal to them."""
    rows = (ROWS[name] for name in PARALLELISMS)
    return "\n".join(f"| {r.title} | {r.state} | {r.covers} | [{r.link}]({r.page}) |" for r in rows)


def validate_layout(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig,
                    runtime: bool = True) -> ParallelConfig:
    """Every cross-check of layout, model and training settings (one-line ConfigError on failure): the options'
    values, the support table, then each parallelism's rules in the registry's order; ``runtime`` False leaves
    out the support table (pairs this runtime does not run), for estimates that only compute."""
    check_values(parallel)
    if runtime:
        check_pairs(features(model, train, parallel))
    for p in PARALLELISMS.values():
        if p.check is not None:
            p.check(parallel, model, train)
    train.validate(model, dp=parallel.dims.dp)
    return parallel
