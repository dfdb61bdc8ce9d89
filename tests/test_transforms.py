"""Every pair of features the support table accepts validates, and ``parallelize`` applies every transform
the layout asks for: no request is accepted and then silently skipped (the way full recomputation was once
skipped by the per-parameter engines).

Each layout is built in this one process over one-rank groups (every mesh dimension of size 1), which is
enough to see what ``parallelize`` did to the model and which gradient sync it chose; the equivalence tests
run the same layouts on real multi-process groups. The transforms are recognised by what they leave behind:
tensor-parallel modules and their regions' settings, the attention core context parallelism installed,
expert-parallel experts, checkpointed forwards, the pipeline schedule and its split linears, the sharding
engine's plan (ZeRO-3 and FULL_SHARD free their gathered weights right away), the compute dtype.
"""

import itertools

import pytest
import torch

from parallelisms.comm import CommLedger, Comms, Timeline
from parallelisms.model import build_model
from parallelisms.parallel.context import RingAttentionCore, UlyssesAttentionCore
from parallelisms.parallel.cp_allgather import AllGatherAttentionCore
from parallelisms.parallel.data import DataParallel
from parallelisms.parallel.expert import ExpertParallelExperts
from parallelisms.parallel.flat import ShardedEngine
from parallelisms.parallel.fsdp2 import PerParamSharding
from parallelisms.parallel.pipeline.pipedream import WeightStashing
from parallelisms.parallel.pipeline.runner import PipelineSchedule
from parallelisms.parallel.pipeline.stage_sync import StageSyncs
from parallelisms.parallel.recompute import _checkpointed_forward
from parallelisms.parallel.tensor import ColumnParallelLinear, Region
from parallelisms.parallel.yafsdp import ReuseSharding
from parallelisms.support import FLAGS, UNSUPPORTED, features, validate_layout
from parallelisms.training import parallelize

from _layouts import layout_with

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)


def _pairs():
    """Every accepted pair of features that one layout can hold together (not two ZeRO stages, say)."""
    out = []
    for pair in itertools.combinations(FLAGS, 2):
        if frozenset(pair) in UNSUPPORTED:
            continue
        model, train, parallel = layout_with(pair)
        if set(pair) <= set(features(model, train, parallel)):
            out.append(pair)
    return out


PAIRS = _pairs()


def _modules(trainer):
    stages = trainer.forward_backward.stages.values() if isinstance(trainer.forward_backward, PipelineSchedule) \
        else [trainer.forward_backward.model]
    return [m for stage in stages for m in stage.modules()]


def _engines(grad_sync):
    return list(grad_sync.engines.values()) if isinstance(grad_sync, StageSyncs) else [grad_sync]


def _regions(modules):
    return [m.region for m in modules if isinstance(getattr(m, "region", None), Region)]


def _applied(feature: str, trainer, modules) -> bool:
    """Whether ``trainer`` (what parallelize returned) carries out ``feature``."""
    engines = _engines(trainer.grad_sync)
    layers = [m for m in modules if hasattr(m, "attention") and hasattr(m, "feed_forward")]
    if feature == "ddp":  # mixed precision runs DDP as the flat engine's NO_SHARD plan (replicated over dp)
        return all(isinstance(e, DataParallel) for e in engines) or all(
            isinstance(e, ShardedEngine) and e.plan.shard_dim is None and e.plan.replicate_dim for e in engines)
    if feature.startswith("zero") or feature.startswith("fsdp-"):
        if not all(isinstance(e, (ShardedEngine, PerParamSharding)) for e in engines):
            return False
        flat = [e for e in engines if isinstance(e, ShardedEngine)]
        stage = int(feature[-1]) if feature.startswith("zero") else None
        frees = stage == 3 or feature in ("fsdp-full_shard", "fsdp-shard_grad_op", "fsdp-hybrid_shard",
                                          "fsdp-hybrid_shard_zero2")
        # sharded parameters hold no gathered storage between uses (ZeRO-3 frees gathered weights)
        return all(e.plan.shard_params == frees and e.plan.shard_grads == (stage != 1 and feature != "fsdp-no_shard")
                   and all((u.full.untyped_storage().nbytes() == 0) == frees for u in e.units) for e in flat)
    if feature == "per_param":
        return all(type(e) is PerParamSharding for e in engines)
    if feature == "reuse":
        return all(isinstance(e, ReuseSharding) for e in engines)
    if feature == "tp":
        return any(isinstance(m, ColumnParallelLinear) for m in modules)
    if feature == "sp":
        return bool(_regions(modules)) and all(r.sequence_parallel for r in _regions(modules))
    if feature == "tp-overlap":
        return bool(_regions(modules)) and all(r.overlap for r in _regions(modules))
    if feature == "ring":
        return all(isinstance(layer.attention.core, RingAttentionCore) for layer in layers)
    if feature == "ulysses":
        return all(isinstance(layer.attention.core, UlyssesAttentionCore) for layer in layers)
    if feature == "allgather":
        return all(isinstance(layer.attention.core, AllGatherAttentionCore) for layer in layers)
    if feature == "hierarchical":  # Ulysses around the ring (in position order)
        return all(isinstance(layer.attention.core, UlyssesAttentionCore)
                   and isinstance(layer.attention.core.inner.inner, RingAttentionCore) for layer in layers)
    if feature == "moe":
        return all(hasattr(layer.feed_forward, "router") for layer in layers)
    if feature == "ep":
        return all(isinstance(layer.feed_forward.experts, ExpertParallelExperts) for layer in layers)
    if feature == "pp":
        return isinstance(trainer.forward_backward, PipelineSchedule)
    if feature in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipe", "dualpipev", "pipedream"):
        schedule = trainer.forward_backward.schedule
        # a split backward defers every linear's weight gradient: no plain linear is left, every TP region knows
        # the W-store
        split = not schedule.split_backward or (not any(type(m) is torch.nn.Linear for m in modules)
                                                and all(r.store is not None for r in _regions(modules)))
        return schedule.name == feature and split
    if feature == "recompute-full":
        return all(getattr(layer.forward, "__func__", None) is _checkpointed_forward for layer in layers)
    if feature == "recompute-selective":
        return all(getattr(layer.attention.core.forward, "__func__", None) is _checkpointed_forward
                   for layer in layers)
    if feature == "bf16":
        executor = getattr(trainer.forward_backward, "executor", None)
        forward = getattr(executor, "forward_fn", None)
        stashing = getattr(getattr(forward, "func", forward), "__self__", None)  # unwrapped from its positions
        if isinstance(stashing, WeightStashing):  # PipeDream: stashed versions are bf16 casts, bf16 activations
            return stashing.compute_dtype == executor.dtype == torch.bfloat16
        # every gradient sync is a sharding engine computing in bf16 (DDP: the flat engine's NO_SHARD plan)
        return all((e.plan.compute_dtype if isinstance(e, ShardedEngine) else getattr(e, "compute_dtype", None))
                   == torch.bfloat16 for e in engines)
    if feature == "float64":
        return all(p.dtype == torch.float64 for e in engines for p in e.parameters())
    raise AssertionError(f"no check for feature {feature}")


@pytest.mark.parametrize("pair", PAIRS, ids="+".join)
def test_accepted_pair_validates_and_applies_both_transforms(pair):
    model_cfg, train, parallel = layout_with(pair)
    parallel = validate_layout(model_cfg, train, parallel)  # the table says it runs: no other check refuses it
    torch.manual_seed(0)
    model = build_model(model_cfg, 0, dtype=train.torch_dtype)
    trainer = parallelize(model, parallel, train, Comms({}, CommLedger(), Timeline(0)))
    modules = _modules(trainer)
    missing = [f for f in features(model_cfg, train, parallel) if not _applied(f, trainer, modules)]
    assert not missing, f"{pair}: accepted but not applied: {missing}"


def test_the_pairs_cover_every_feature():
    assert {f for pair in PAIRS for f in pair} == set(FLAGS)
