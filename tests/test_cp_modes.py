"""The context-parallel modes added through the registry (:mod:`parallelisms.parallel.cp_modes`): all-gather
attention and hierarchical (Ulysses inside x ring across) reproduce full causal attention and float64
single-process training (within 1e-10) alone and with tensor, data (ZeRO-3, ZeRO-1) and pipeline
parallelism; their collectives are the ones the registry prices; their rules are one line before launch."""

import pytest
import torch

from parallelisms.comm import CommLedger, Comms
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.errors import ConfigError
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.model.transformer import CausalAttentionCore
from parallelisms.parallel.cp_modes import MODES, Shape
from parallelisms.equivalence import TOLERANCE_FLOAT64, batch_slices, compare, reference_train

from parallelisms.training import RunSpec

from _launching import launch_reports, one_thread

B, HQ, HKV, S, D = 2, 8, 4, 16, 4
NEW_MODES = {2: ("allgather",), 4: ("allgather", "hierarchical")}  # hierarchical: Ulysses 2 x ring 2


def _attention_rank(info):
    n = info.world_size
    comms = Comms(ParallelDims(cp=n).build_meshes(), CommLedger())
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV))
    weight = torch.randn(B, HQ, S, D, generator=gen, dtype=torch.float64)
    ref = CausalAttentionCore()(q, k, v)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    results = {}
    for style in NEW_MODES[n]:
        mode, parallel = MODES[style], ParallelConfig(ParallelDims(cp=n), cp_attention=style, cp_ulysses_size=2)
        shape = Shape(n, 2, HQ, HKV, S)
        held = [torch.tensor(mode.positions(shape, r)) for r in range(n)]
        pos = held[info.rank]
        module, name = mode.core.split(":")
        core = getattr(__import__(module, fromlist=[name]), name)(comms, held, CausalAttentionCore(), parallel)
        local = [t.detach()[:, :, pos].clone().requires_grad_(True) for t in (q, k, v)]
        mark = comms.ledger.mark()
        with comms.ledger.in_phase("forward"):
            out = core(*local)
        with comms.ledger.in_phase("backward"):
            (out * weight[:, :, pos]).sum().backward()
        results[style] = {"out_err": (out - ref.detach()[:, :, pos]).abs().max().item(),
                          "grad_err": max((t.grad - g[:, :, pos]).abs().max().item() for t, g in zip(local, ref_grads)),
                          "records": [(r.kind, r.dim, r.numel, r.phase) for r in comms.ledger.records[mark:]]}
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def attention(request):
    return request.param, launch(_attention_rank, request.param, threads=1)


def test_matches_full_causal_attention_forward_and_backward(attention):
    n, per_rank = attention
    for result in per_rank:
        for style in NEW_MODES[n]:
            assert result[style]["out_err"] < 1e-12 and result[style]["grad_err"] < 1e-12, (style, result[style])


def test_all_gather_gathers_k_and_v_once_and_reduce_scatters_their_gradients(attention):
    n, per_rank = attention
    kv = 2 * B * HKV * S * D  # K and V of the whole sequence: the gather's output, the reduce-scatter's input
    assert per_rank[0]["allgather"]["records"] == [("all_gather", "cp", kv, "forward"),
                                                   ("reduce_scatter", "cp", kv, "backward")]


def test_hierarchical_runs_all_to_alls_inside_and_the_ring_across(attention):
    n, per_rank = attention
    if n != 4:
        pytest.skip("hierarchical needs cp 4 here (Ulysses 2 x ring 2)")
    records = per_rank[0]["hierarchical"]["records"]
    forward = [(kind, dim) for kind, dim, _, phase in records if phase == "forward"]
    assert forward.count(("all_to_all", "cp_inner")) == 4 and forward.count(("send", "cp_outer")) == 2  # K, V: 1 hop
    assert {dim for _, dim, _, _ in records} == {"cp_inner", "cp_outer"}


MODEL = preset("tiny")
TRAIN = TrainConfig(steps=2, global_batch=8, seq_len=16, grad_clip=0.0, dtype="float64")
LAYOUTS = {
    "allgather_cp2": ParallelConfig(ParallelDims(cp=2), cp_attention="allgather"),
    "allgather_cp4": ParallelConfig(ParallelDims(cp=4), cp_attention="allgather"),
    "allgather_cp2_tp2": ParallelConfig(ParallelDims(cp=2, tp=2), cp_attention="allgather"),
    "allgather_dp2_cp2_zero3": ParallelConfig(ParallelDims(dp_shard=2, cp=2), zero=3, cp_attention="allgather"),
    "allgather_pp2_cp2_1f1b": ParallelConfig(ParallelDims(pp=2, cp=2), schedule="1f1b", microbatches=4,
                                             cp_attention="allgather"),
    "hierarchical_cp4": ParallelConfig(ParallelDims(cp=4), cp_attention="hierarchical", cp_ulysses_size=2),
    "hierarchical_cp4_tp2": ParallelConfig(ParallelDims(cp=4, tp=2), cp_attention="hierarchical", cp_ulysses_size=2),
    "hierarchical_dp2_cp4_zero1": ParallelConfig(ParallelDims(dp_shard=2, cp=4), zero=1, cp_attention="hierarchical",
                                                 cp_ulysses_size=2),
    "hierarchical_pp2_cp4_1f1b": ParallelConfig(ParallelDims(pp=2, cp=4), schedule="1f1b", microbatches=4,
                                                cp_attention="hierarchical", cp_ulysses_size=2),
}
SPECS = {name: RunSpec(MODEL, TRAIN, parallel, collect_state=True) for name, parallel in LAYOUTS.items()}
REPORTS = launch_reports(SPECS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_float64_training_matches_single_process(name):
    parallel = LAYOUTS[name]
    with one_thread():
        reference = reference_train(MODEL, TRAIN, splits=batch_slices(parallel, TRAIN))
    result = compare(REPORTS(name), reference, TOLERANCE_FLOAT64)
    assert result["ok"], (name, result)


@pytest.mark.fast
def test_positions_cover_the_sequence_with_equal_causal_work():
    shape = Shape(4, 2, 4, 2, 64)
    # hierarchical: the 2 ranks of a Ulysses group attend the group's tokens together (heads split), so the
    # balance that matters is the groups' (the ring's)
    for style, together in (("allgather", 1), ("hierarchical", 2)):
        held = [MODES[style].positions(shape, r) for r in range(4)]
        assert sorted(sum(held, [])) == list(range(64))
        work = [sum(p + 1 for ps in held[g:g + together] for p in ps) for g in range(0, 4, together)]
        assert len(set(work)) == 1, (style, work)  # unmasked (query, key) pairs per rank (or group)


@pytest.mark.fast
def test_the_rules_are_one_line_before_launch():
    with pytest.raises(ConfigError, match="all-gather attention with --cp 4 cuts the sequence into 2 x cp = 8"):
        MODES["allgather"].check(Shape(4, 0, 4, 2, 12))
    with pytest.raises(ConfigError, match="--cp-ulysses-size 3 must divide it, between 2 and 2: one of \\[2\\]"):
        MODES["hierarchical"].check(Shape(4, 3, 4, 2, 16))
    with pytest.raises(ConfigError, match="Ulysses --cp-ulysses-size 4 gives each rank heads/4"):
        MODES["hierarchical"].check(Shape(8, 4, 2, 1, 16))
