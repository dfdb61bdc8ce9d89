"""ZeRO-1/2/3 on the flat engine reproduce single-process AdamW (fp32 within 1e-5; bf16 against a bf16
reference), clip by the global norm of sharded gradients, hold the memory ZeRO predicts, and send the
bytes it predicts: stages 1-2 as much as DDP's all-reduce, stage 3 1.5x. Bad input fails before launch.

One launch per world size runs every scenario (process start-up dominates on two cores).
"""

import pytest
import torch

from parallelisms.cli import main
from parallelisms.comm import Comms
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.parallel.flat import ShardedEngine
from parallelisms.parallel.wrap import module_units
from parallelisms.parallel.fsdp2 import PerParamSharding
from parallelisms.parallel.zero import zero_plan
from parallelisms.parallel.memory import zero_formula
from parallelisms.training import RunSpec, train_rank
from parallelisms.equivalence import BF16_TOLERANCE, compare, reference_train, reference_train_bf16

from _launching import launch_once_per_world, settled

MODEL = preset("tiny")
BASE = TrainConfig(steps=3, global_batch=8, seq_len=32, bucket_mb=0.3)  # ZeRO-1/2: two gradient buckets
CLIP = BASE.replace(grad_clip=0.05)  # far below the gradient norm (about 1), so clipping scales every step
ACCUM = BASE.replace(grad_accum=2)
# bf16 runs without clipping: a last-bit difference in the clip coefficient (the norm summed in another
# order) flips the bf16 rounding of a few weights, which is not a property of the sharding
MIXED = BASE.replace(grad_clip=0.0)
SCENARIOS = {  # name: (zero stage, train config, mixed precision, world sizes)
    "zero1": (1, BASE, "fp32", (2, 4)),
    "zero2": (2, BASE, "fp32", (2, 4)),
    "zero3": (3, BASE, "fp32", (2, 4)),
    "zero1_accum": (1, ACCUM, "fp32", (2,)),
    "zero3_accum": (3, ACCUM, "fp32", (2,)),
    "zero2_clip": (2, CLIP, "fp32", (2,)),
    "zero3_clip": (3, CLIP, "fp32", (4,)),
    "zero3_bf16": (3, MIXED, "bf16", (2,)),
    "zero1_bf16": (1, MIXED, "bf16", (2,)),
}


def _run(info, world):
    reports = {}
    for name, (stage, cfg, precision, worlds) in SCENARIOS.items():
        if world in worlds:
            parallel = ParallelConfig(ParallelDims(dp_shard=world), zero=stage, mixed_precision=precision)
            reports[name] = train_rank(info, RunSpec(MODEL, cfg, parallel, collect_state=True))
    return reports


@pytest.fixture(scope="module")
def runs():
    """world size -> rank 0's reports of every scenario at that size (one launch each, on first use)."""
    return launch_once_per_world(_run)


@pytest.fixture(params=[2, 4], ids=["dp2", "dp4"])
def run(request, runs):
    return request.param, runs(request.param)


@pytest.fixture(scope="module")
def references():
    return {cfg: reference_train(MODEL, cfg) for cfg in (BASE, CLIP, ACCUM, MIXED)}


@pytest.mark.parametrize("name, world", [(n, w) for n, (*_, worlds) in SCENARIOS.items() for w in worlds])
def test_reproduces_single_process_adamw(runs, references, name, world):
    _, cfg, precision, _ = SCENARIOS[name]
    report = runs(world)[name]
    if precision == "bf16":
        # the same arithmetic in one process (per-rank bf16 gradients summed in fp32): the fp32 contract
        exact = compare(report, reference_train_bf16(MODEL, cfg, splits=world))
        assert exact["ok"], exact
        # one bf16 gradient of the whole batch: within BF16_TOLERANCE, and much closer than fp32 training
        result = compare(report, reference_train_bf16(MODEL, cfg), BF16_TOLERANCE)
        assert result["ok"], result
        fp32 = compare(report, references[cfg], BF16_TOLERANCE)
        assert result["max_param_rel_diff"] < fp32["max_param_rel_diff"] / 2, (result, fp32)
    else:
        result = settled(report, MODEL, cfg, references[cfg])
    assert result["ok"], result


@pytest.mark.fast
def test_clipping_bites_and_matches(references):
    """The clipped reference differs from the unclipped one, so the *_clip scenarios test clipping."""
    unclipped = reference_train(MODEL, CLIP.replace(grad_clip=0.0))
    diff = compare(unclipped, references[CLIP])
    assert diff["max_param_rel_diff"] > 1e-3


def test_persistent_memory_matches_zero_formulas(run):
    world, reports = run
    psi = MODEL.num_params()
    largest_unit, largest_bucket = _largest_unit_numel(), _largest_unit_numel(int(BASE.bucket_mb * 2**20))
    for stage in (1, 2, 3):
        got = reports[f"zero{stage}"]["memory"]
        want = zero_formula(psi, world, stage)
        for kind in ("params", "grads", "optimizer"):
            assert got[kind] == pytest.approx(want[kind], rel=0.05), (stage, kind, got, want)
        if stage == 2:  # one bucket's gradient in flight while autograd produces the next
            assert largest_bucket * 4 <= got["grad_buffers_peak"] <= 2 * largest_bucket * 4
        if stage == 3:  # the unit computing plus the prefetched next one
            assert largest_unit * 4 <= got["gathered_params_peak"] <= 2 * largest_unit * 4
    bf16 = reports.get("zero1_bf16")
    if bf16 is not None:  # bf16 params and grads, fp32 master (with the optimizer state) and reduced grad shard
        want = zero_formula(psi, world, 1, param_bytes=2, grad_bytes=2, master_bytes=4, master_grad_bytes=4)
        for kind in ("params", "grads", "optimizer"):
            assert bf16["memory"][kind] == pytest.approx(want[kind], rel=0.05), (kind, bf16["memory"], want)


def test_zero3_prefetches_every_gather_but_the_first_of_each_pass(run):
    """Forward: the embedding's gather is on demand, each later unit's was issued by the previous unit's
    pre-forward hook; backward: the head's on demand (freed after forward), each earlier unit's prefetched."""
    _, reports = run
    units = MODEL.n_layers + 2
    memory = reports["zero3"]["memory"]
    assert memory["on_demand_gathers"] == 2 * BASE.steps
    assert memory["prefetched_gathers"] == 2 * (units - 1) * BASE.steps


@pytest.mark.parametrize("style", ["flat", "per_param"])
@pytest.mark.fast
def test_backward_prefetch_waits_for_the_mlp_backward(style):
    """Each block's backward gathers the previous unit only after its MLP's backward (the activations it
    frees are where backward memory peaks), still before its attention's backward. One process: the
    engine's one-rank Comm gathers by copy, the hooks run the same. (The per-parameter engine never gathers
    the embedding for backward, which needs no weights: block 0 has nothing to prefetch.)"""
    model = build_model(MODEL)
    if style == "flat":
        engine, method, blocks = ShardedEngine(model, module_units(model), zero_plan(3), Comms()), "_unshard", 0
    else:
        engine, method, blocks = PerParamSharding(model, Comms(), "dp_shard"), "_issue_gather", 1
    events, gather = [], getattr(engine, method)
    setattr(engine, method, lambda unit: (events.append(("gather", engine.units.index(unit))), gather(unit))[1])
    for i, block in enumerate(model.layers.values()):
        block.feed_forward.register_full_backward_hook(lambda *_, i=i: events.append(("mlp", i)))
        block.attention.register_full_backward_hook(lambda *_, i=i: events.append(("attention", i)))
    tokens = torch.randint(0, MODEL.vocab_size, (2, 16))
    loss = model(tokens, tokens)
    events.clear()
    loss.backward()
    for i in range(blocks, MODEL.n_layers):  # block i is unit i + 1, after the embedding
        order = [events.index(e) for e in (("mlp", i), ("gather", i), ("attention", i))]
        assert order == sorted(order), (i, events)


def _largest_unit_numel(cap_bytes=None):
    units = module_units(build_model(MODEL), cap_bytes)
    assert cap_bytes is None or len(units) == 2
    return max(sum(p.numel() for m in modules for p in m.parameters()) for _, modules in units)


def test_ledger_bytes_match_data_parallel(run):
    """Stages 1-2: reduce-scatter + all-gather = DDP's 2(N-1)/N x G; stage 3: two all-gathers, 1.5x."""
    world, reports = run
    ring = (world - 1) / world * MODEL.num_params() * 4
    for stage in (1, 2, 3):
        comm = reports[f"zero{stage}"]["comm"]
        assert comm["reduce_scatter"]["bytes_per_rank"] == pytest.approx(ring, rel=1e-9)
        gathers = 2 if stage == 3 else 1
        assert comm["all_gather"]["bytes_per_rank"] == pytest.approx(gathers * ring, rel=1e-9)
        total = comm["reduce_scatter"]["bytes_per_rank"] + comm["all_gather"]["bytes_per_rank"]
        assert total == pytest.approx((1.5 if stage == 3 else 1.0) * 2 * ring, rel=1e-9)
        assert comm["all_reduce"]["bytes_per_rank"] < 16  # only the squared gradient norm for clipping
        units = 2 if stage < 3 else MODEL.n_layers + 2  # ZeRO-1/2: two buckets under --bucket-mb 0.3
        assert comm["reduce_scatter"]["calls"] == pytest.approx(units)


@pytest.mark.parametrize("argv, needle", [
    (["--dp", "1", "--zero", "2"], "data-parallel degree is 1"),
    (["--dp", "2", "--zero", "4"], "--zero: must be an integer from 0 to 3, got 4"),
    (["--dp", "2", "--pp", "2", "--schedule", "pipedream", "--fsdp", "full_shard", "--fsdp-style", "reuse"], "--fsdp full_shard with --schedule pipedream: PipeDream updates a stage after every microbatch"),
    (["--dp", "2", "--zero", "1", "--mixed-precision", "bf16", "--dtype", "float64"], "--mixed-precision bf16 with --dtype float64"),
    (["--dp", "4", "--fsdp", "hybrid_shard"], "needs a 2-D layout"),
    (["--dp", "2", "--fsdp", "fully_sharded"], "choose one of full_shard, shard_grad_op"),
    (["--dp", "2", "--zero", "3", "--fsdp", "full_shard"], "pick one"),
    (["--dp", "2", "--zero", "3", "--overlap-param-gather"], "needs --zero 1 or 2 without --pp (got --zero 3"),
    (["--tp", "2", "--sp", "--tp-overlap-chunks", "2"], "needs --tp-overlap; add --tp-overlap"),
    (["--dp-replicate", "2", "--dp-shard", "2", "--fsdp", "full_shard"], "needs --fsdp hybrid_shard"),
    (["--dp", "2", "--mixed-precision", "fp16"], "unknown --mixed-precision 'fp16'"),
])
def test_bad_input_is_one_line_before_launch(capsys, argv, needle):
    assert main(["verify", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
