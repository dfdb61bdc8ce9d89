"""A small layout switching on given support-table features (shared by the support and transform tests)."""

import dataclasses

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.registry import PARALLELISMS

DEEP = ModelConfig(vocab_size=256, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
DEEP_MOE = dataclasses.replace(DEEP, n_experts=4, top_k=2)
FEATURES = {name: f for p in PARALLELISMS.values() for name, f in p.features.items()}


def layout_with(names) -> tuple[ModelConfig, TrainConfig, ParallelConfig]:
    """A small layout switching on the features ``names`` (and only what they imply): the rows of their
    parallelisms' descriptors (parallelisms.parallel.registry) merged."""
    dims, opts, model, train = {}, {}, DEEP, TrainConfig(global_batch=16, seq_len=32)
    for name in names:
        row = FEATURES[name]
        dims.update(row.dims)
        opts.update(row.options)
        model = DEEP_MOE if row.moe else model
        train = train.replace(**row.train)
    if dims.get("ep") and dims.get("dp_replicate", 1) * dims.get("dp_shard", 1) * dims.get("cp", 1) < 2:
        # expert parallelism is carved out of the data-parallel ranks: add them if no feature brings them
        dims["dp_shard" if (opts.get("zero") or opts.get("fsdp")) else "dp_replicate"] = 2
    return model, train, ParallelConfig(ParallelDims(**dims), **opts)


def assert_same_dry_runs(expected: dict, got: dict) -> None:
    """Two dry runs of one layout agree: the precheck (passing), and per rank class the ledger, events and memory."""
    assert got["precheck"] == expected["precheck"] and expected["precheck"]["ok"], expected["precheck"]
    for rank, run in expected["runs"].items():
        assert got["runs"][rank].records == run.records, rank
        assert got["runs"][rank].events == run.events, rank
        assert got["runs"][rank].memory == run.memory, rank
