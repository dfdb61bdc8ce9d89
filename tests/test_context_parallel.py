"""Context parallelism: ring attention (exact log-sum-exp merging, hand-written ring backward, zigzag
balance) and Ulysses reproduce full causal attention and single-process training."""

import pytest
import torch

from parallelisms.cli import main
from parallelisms.comm import CommLedger, Comms
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.context import RingAttentionCore, UlyssesAttentionCore, block_plan, shard_sequence
from parallelisms.model.transformer import CausalAttentionCore
from parallelisms.training import RunSpec, train_rank
from parallelisms.equivalence import reference_train

from _launching import settled

B, HQ, HKV, S, D = 2, 8, 4, 16, 4


def _full_attention_and_grads(seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV))
    weight = torch.randn(B, HQ, S, D, generator=gen, dtype=torch.float64)
    for t in (q, k, v):
        t.requires_grad_(True)
    out = CausalAttentionCore()(q, k, v)
    (out * weight).sum().backward()
    return (q, k, v, weight), out.detach(), [t.grad for t in (q, k, v)]


def _attention_rank(info):
    n = info.world_size
    comms = Comms(ParallelDims(cp=n).build_meshes(), CommLedger())
    (q, k, v, weight), ref_out, ref_grads = _full_attention_and_grads(seed=1)
    results = {}
    for style in ("ring", "ring_unfused", "ring_contiguous", "ulysses"):
        pos = shard_sequence(S, info.rank, n, zigzag=style in ("ring", "ring_unfused"))
        local = [t.detach()[:, :, pos].clone().requires_grad_(True) for t in (q, k, v)]
        if style == "ulysses":
            core = UlyssesAttentionCore(comms["cp"], CausalAttentionCore())
        else:  # the fused kernel (CPU flash attention, float64 too), the materialised fallback, no zigzag
            core = RingAttentionCore(comms["cp"], pos, zigzag=style != "ring_contiguous", fused=style != "ring_unfused")
        mark = comms.ledger.mark()
        with comms.ledger.in_phase("forward"):
            out = core(*local)
        with comms.ledger.in_phase("backward"):
            (out * weight[:, :, pos]).sum().backward()
        results[style] = {
            "out_err": (out - ref_out[:, :, pos]).abs().max().item(),
            "grad_err": max((t.grad - g[:, :, pos]).abs().max().item() for t, g in zip(local, ref_grads)),
            "records": [(r.kind, r.numel, r.phase) for r in comms.ledger.records[mark:]],
        }
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def attention(request):
    return request.param, launch(_attention_rank, request.param, threads=1)


@pytest.mark.parametrize("style", ["ring", "ring_unfused", "ring_contiguous", "ulysses"])
def test_matches_full_causal_attention_forward_and_backward(attention, style):
    _, per_rank = attention
    for result in per_rank:
        assert result[style]["out_err"] < 1e-12 and result[style]["grad_err"] < 1e-12  # float64: exact up to rounding


@pytest.mark.parametrize("style", ["ring", "ring_unfused"])
def test_ring_sends_only_local_blocks(attention, style):
    n, per_rank = attention
    block = B * HKV * (S // n) * D  # one rank's K (or V) block: no rank ever sends or holds more
    records = per_rank[0][style]["records"]
    forward_sends = [r for r in records if r[0] == "send" and r[2] == "forward"]
    backward_sends = [r for r in records if r[0] == "send" and r[2] == "backward"]
    assert len(forward_sends) == 2 * (n - 1)               # K and V, N-1 hops
    assert len(backward_sends) == 2 * (n - 1) + 2 * n      # K and V again, and dK, dV one hop further home
    assert all(r[1] == block for r in forward_sends + backward_sends)
    assert {r[0] for r in records} == {"send", "recv"}


def test_ulysses_uses_two_all_to_alls_each_way(attention):
    _, per_rank = attention
    records = per_rank[0]["ulysses"]["records"]
    assert [r[0] for r in records if r[2] == "forward"] == ["all_to_all"] * 4   # q, k, v in; output back
    assert [r[0] for r in records if r[2] == "backward"] == ["all_to_all"] * 4


@pytest.mark.fast
def test_zigzag_shards_cover_the_sequence_and_balance_causal_work():
    n, seq = 4, 32
    shards = [shard_sequence(seq, r, n, zigzag=True) for r in range(n)]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    work = [sum(int(p) + 1 for p in s) for s in shards]  # unmasked (query, key) pairs per rank
    assert len(set(work)) == 1
    contiguous = [sum(int(p) + 1 for p in shard_sequence(seq, r, n, zigzag=False)) for r in range(n)]
    assert max(contiguous) > 3 * min(contiguous)          # why zigzag: contiguous chunks are unbalanced


@pytest.mark.fast
def test_block_plan_skips_masked_blocks_and_masks_only_the_diagonal():
    n, seq = 4, 32   # chunks of 4 positions; rank 1 holds chunks 1 and 6
    q = shard_sequence(seq, 1, n, zigzag=True)
    plans = {owner: block_plan(q, shard_sequence(seq, owner, n, zigzag=True)) for owner in range(n)}
    assert plans[1] == [(slice(0, 8), slice(0, 8), True)]                  # its own block: one causal call
    assert plans[0] == [(slice(0, 8), slice(0, 4), False)]                 # earlier rank: its first chunk, unmasked
    assert plans[2] == plans[3] == [(slice(4, 8), slice(0, 8), False)]     # later ranks: the second chunk sees all
    contiguous = [block_plan(shard_sequence(seq, 2, n, False), shard_sequence(seq, o, n, False)) for o in range(n)]
    assert contiguous == [[(slice(0, 8), slice(0, 8), False)]] * 2 + [[(slice(0, 8), slice(0, 8), True)], []]


MODEL = preset("tiny")
TRAIN = TrainConfig(steps=4, global_batch=8, seq_len=32)
LAYOUTS = {"ring_cp2": (ParallelDims(cp=2), "ring"), "ulysses_cp2": (ParallelDims(cp=2), "ulysses"),
           "ring_dp2_cp2": (ParallelDims(dp_replicate=2, cp=2), "ring"),
           "ulysses_dp2_cp2": (ParallelDims(dp_replicate=2, cp=2), "ulysses")}


def _train_rank(info, names):
    return {name: train_rank(info, RunSpec(MODEL, TRAIN, ParallelConfig(dims, cp_attention=style),
                                           collect_state=True))
            for name, (dims, style) in LAYOUTS.items() if name in names}


@pytest.mark.parametrize("world, names", [(2, ["ring_cp2", "ulysses_cp2"]), (4, ["ring_dp2_cp2", "ulysses_dp2_cp2"])])
def test_training_matches_single_process(world, names):
    reports = launch(_train_rank, world, names, threads=1)[0]
    ref = reference_train(MODEL, TRAIN)
    for name in names:
        result = settled(reports[name], MODEL, TRAIN, ref)
        assert result["ok"], (name, result)


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--dp", "1", "--cp", "2", "--seq-len", "30"], "not divisible by 4"),
    (["train", "--dp", "1", "--cp", "8", "--cp-attention", "ulysses"], "n_heads 4 and n_kv_heads 2 do not fit 8"),
    (["train", "--dp", "1", "--cp", "2", "--cp-attention", "tree"], "unknown --cp-attention 'tree'"),
])
def test_bad_context_parallel_input(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
