"""Mixture of experts (router, top-k, per-sequence capacity and load balancing, grouped GEMM) and expert
parallelism (all-to-all dispatch and combine, experts kept by their owners) against plain computation; MoE
models under ZeRO and FSDP with replicated experts."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from parallelisms.cli import main
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.model.moe import MoE, grouped_swiglu
from parallelisms.training import RunSpec, train_rank

from _launching import settled

MOE = preset("tiny-moe")


def _expert(x, moe, e):
    return (F.silu(x @ moe.experts.w_gate[e]) * (x @ moe.experts.w_up[e])) @ moe.experts.w_down[e]


def _naive_moe(moe: MoE, x):
    """Token by token: each kept top-k assignment runs its expert alone."""
    top_experts, weights, keep, _ = moe.route(x)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            for j in range(moe.top_k):
                if keep[b, s, j]:
                    out[b, s] += weights[b, s, j] * _expert(x[b, s], moe, top_experts[b, s, j])
    return out


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0, 0.5])
@pytest.mark.fast
def test_moe_equals_token_by_token_experts(capacity_factor):
    model = build_model(dataclasses.replace(MOE, capacity_factor=capacity_factor), seed=1)
    moe = model.layers["0"].feed_forward
    x = torch.randn(2, 12, MOE.dim, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(moe(x), _naive_moe(moe, x), atol=1e-5)
    counts = moe.tokens_per_expert
    if capacity_factor:
        cap = -(-int(capacity_factor * 12 * MOE.top_k) // MOE.n_experts)
        _, _, keep, _ = moe.route(x)
        top = moe.route(x)[0]
        for b in range(2):  # no sequence sends an expert more than its capacity
            kept = top[b][keep[b]]
            assert torch.bincount(kept, minlength=MOE.n_experts).max() <= cap
        assert counts.sum() < 2 * 12 * MOE.top_k  # something was dropped
    else:
        assert counts.sum() == 2 * 12 * MOE.top_k


@pytest.mark.fast
def test_grouped_gemm_handles_empty_experts():
    gen = torch.Generator().manual_seed(0)
    w_gate, w_up, w_down = torch.randn(4, 6, 5, generator=gen), torch.randn(4, 6, 5, generator=gen), torch.randn(
        4, 5, 6, generator=gen)
    counts = torch.tensor([3, 0, 1, 2])
    x = torch.randn(6, 6, generator=gen)
    expected = torch.cat([(F.silu(x[i:i + 1] @ w_gate[e]) * (x[i:i + 1] @ w_up[e])) @ w_down[e]
                          for i, e in enumerate([0, 0, 0, 2, 3, 3])])
    assert torch.allclose(grouped_swiglu(x, counts, w_gate, w_up, w_down), expected, atol=1e-5)


@pytest.mark.fast
def test_routing_and_aux_loss_do_not_depend_on_how_the_batch_is_split():
    moe = build_model(dataclasses.replace(MOE, capacity_factor=1.0), seed=2).layers["1"].feed_forward
    x = torch.randn(4, 10, MOE.dim, generator=torch.Generator().manual_seed(3))
    whole = moe(x)
    aux_whole = moe.aux_loss
    halves = [moe(x[:2]), moe(x[2:])]
    aux_first = moe.aux_loss
    moe(x[:2])
    assert torch.allclose(whole, torch.cat(halves), atol=1e-6)
    assert torch.allclose(aux_whole, (moe.aux_loss + aux_first) / 2, atol=1e-6)
    assert aux_whole.item() >= 0.99  # E sum f_i P_i is at least 1 (equality: perfectly balanced)


CAPPED = dataclasses.replace(MOE, capacity_factor=1.0)
TRAIN = TrainConfig(steps=4, global_batch=8, seq_len=32)
LAYOUTS = {"dp2_ep2": (MOE, ParallelDims(dp_replicate=2, ep=2)),
           "dp2_ep2_capacity": (CAPPED, ParallelDims(dp_replicate=2, ep=2)),
           "dp4_ep2": (MOE, ParallelDims(dp_replicate=4, ep=2)),
           "dp4_ep4_capacity": (CAPPED, ParallelDims(dp_replicate=4, ep=4))}
# MoE models under sharded data parallelism (experts replicated: --ep 1), clipping that bites in one
SHARDED = {"dp2_zero3": (CAPPED, ParallelConfig(ParallelDims(dp_shard=2), zero=3), TRAIN.replace(grad_clip=0.05)),
           "dp4_zero1": (MOE, ParallelConfig(ParallelDims(dp_shard=4), zero=1), TRAIN),
           "dp4_per_param": (MOE, ParallelConfig(ParallelDims(dp_shard=4), fsdp="full_shard",
                                                 fsdp_style="per_param"), TRAIN)}


def _train(info, names):
    runs = {**{n: (cfg, ParallelConfig(dims), TRAIN) for n, (cfg, dims) in LAYOUTS.items()}, **SHARDED}
    return {name: train_rank(info, RunSpec(runs[name][0], runs[name][2], runs[name][1], collect_state=True))
            for name in names}


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def trained(request):
    names = [n for n in [*LAYOUTS, *SHARDED] if n.startswith(f"dp{request.param}")]
    return request.param, launch(_train, request.param, names, threads=1)[0]


def test_expert_parallel_training_matches_single_process(trained):
    _, reports = trained
    for name, report in reports.items():
        model, train = (LAYOUTS[name][0], TRAIN) if name in LAYOUTS else (SHARDED[name][0], SHARDED[name][2])
        result = settled(report, model, train)
        assert result["ok"], (name, result)


def test_expert_parallel_communication(trained):
    world, reports = trained
    for name, report in reports.items():
        if name not in LAYOUTS:
            continue
        cfg, dims = LAYOUTS[name]
        comm = report["comm"]
        # per MoE layer: forward = counts + dispatch + combine all-to-alls, backward = combine + dispatch
        assert comm["all_to_all"]["calls"] == cfg.n_layers * 5
        # expert gradients are reduced only among the ranks holding the same experts
        replicas = world // dims.ep
        expert_bytes = 3 * cfg.n_layers * cfg.n_experts * cfg.dim * cfg.ffn_dim * 4
        dense_bytes = cfg.num_params() * 4 - expert_bytes
        clip = 2 * (dims.ep - 1) / dims.ep * 4  # global-norm clipping: one fp32 sum of squares over ep
        expected = (2 * (world - 1) / world * dense_bytes + 2 * (replicas - 1) / replicas * expert_bytes / dims.ep
                    + clip)
        assert comm["all_reduce"]["bytes_per_rank"] == pytest.approx(expected, rel=1e-12)


# ep 8 with one expert per rank: at this seed, step 0's batch routes no token to layer 1's expert 2, so
# rank 2 of ep receives nothing (it used to drop out of the backward all-to-alls and crash gloo)
EP8_TRAIN = TrainConfig(steps=2, global_batch=8, seq_len=8, seed=10)


def _train_ep8(info):
    return train_rank(info, RunSpec(MOE, EP8_TRAIN, ParallelConfig(ParallelDims(dp_replicate=8, ep=8)),
                                    collect_state=True))


def test_expert_parallel_with_a_rank_whose_expert_gets_no_token():
    model = build_model(MOE, EP8_TRAIN.seed)
    with torch.no_grad():
        model(*BatchLoader(load_corpus(), EP8_TRAIN.global_batch, EP8_TRAIN.seq_len, EP8_TRAIN.seed).shard(0, 0, 1))
    assert model.layers["1"].feed_forward.tokens_per_expert[2] == 0  # the case is hit
    report = launch(_train_ep8, 8, threads=1)[0]
    result = settled(report, MOE, EP8_TRAIN)
    assert result["ok"], result
    assert report["comm"]["all_to_all"]["calls"] == MOE.n_layers * 5


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--ep", "2"], "needs a mixture-of-experts model"),
    (["train", "--preset", "tiny-moe", "--dp", "2", "--ep", "3"], "ep 3 must divide the data-parallel"),
    (["train", "--preset", "tiny-moe", "--dp", "6", "--ep", "3", "--global-batch", "12"], "--ep 3 must divide n_experts 8"),
    (["train", "--preset", "tiny-moe", "--dp", "2", "--ep", "2", "--pp", "2", "--schedule", "pipedream", "--zero", "1"], "--zero 1 with --schedule pipedream"),
])
def test_bad_expert_parallel_input(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


@pytest.mark.fast
def test_the_loss_holds_the_load_balancing_term():
    """The model's loss is the cross-entropy plus aux_loss_coef x the layers' load-balancing losses (a bug
    here is in code verify's reference shares, so only a test of the model sees it)."""
    import torch.nn.functional as F

    model = build_model(MOE, seed=3)
    tokens = torch.randint(0, MOE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = model(tokens, tokens)
    aux = sum(layer.feed_forward.aux_loss for layer in model.layers.values())
    logits = model(tokens)
    cross_entropy = F.cross_entropy(logits.flatten(0, -2), tokens.flatten())
    assert aux.item() > 0.5 and MOE.aux_loss_coef > 0
    assert loss.item() == pytest.approx((cross_entropy + MOE.aux_loss_coef * aux).item(), rel=1e-6)


@pytest.mark.fast
def test_capacity_keeps_exactly_capacity_assignments():
    """Every token prefers expert 0, so it is oversubscribed: exactly ceil(factor x seq x k / E) of its
    assignments per sequence are kept, the earliest ones."""
    import math

    moe = build_model(dataclasses.replace(MOE, capacity_factor=1.0), seed=4).layers["0"].feed_forward
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0].fill_(1.0)
    x = torch.ones(2, 16, MOE.dim)
    top_experts, _, keep, _ = moe.route(x)
    capacity = math.ceil(1.0 * 16 * MOE.top_k / MOE.n_experts)
    to_expert0 = (top_experts == 0) & keep
    assert to_expert0.sum(dim=(1, 2)).tolist() == [capacity, capacity]
    assert to_expert0[:, :capacity].any(-1).all() and not to_expert0[:, capacity:].any()


def _train_dualpipe_traced(info):
    model = preset("tiny-moe")
    train = TrainConfig(steps=2, global_batch=8, seq_len=32)
    parallel = ParallelConfig(ParallelDims(pp=2, dp_replicate=2, ep=2), schedule="dualpipe", microbatches=4)
    from parallelisms.support import validate_layout
    return train_rank(info, RunSpec(model, train, validate_layout(model, train, parallel)), trace=True)


def test_dualpipe_runs_a_backward_while_the_forward_dispatch_is_in_flight():
    """DualPipe's F&B chunks: in the timeline, a backward's compute span starts while an expert all-to-all of
    the same rank is in flight (the forward's dispatch, launched before the backward ran inside it), so that
    all-to-all is not exposed for that time; sequentially run, every expert all-to-all blocks its rank."""
    report = launch(_train_dualpipe_traced, 4, threads=1)[0]
    overlapped = 0
    for spans in report["spans"]:
        a2a = [s for s in spans if s.cat == "comm" and s.name.startswith("all_to_all") and s.args.get("dim") == "ep"]
        backward = [s for s in spans if s.cat == "compute" and s.name.startswith("B ")]
        overlapped += sum(1 for b in backward if any(c.start < b.start < c.end for c in a2a))
    assert overlapped > 0
