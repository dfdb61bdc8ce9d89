"""Data parallelism written here reproduces single-process training, communicates exactly 2(N-1)/N x G
per step, overlaps with backward, and names parameters that got no gradient.

Pattern for multi-process tests: one module-level entry function runs several scenarios in one launch
(process start-up dominates on two cores), returns plain data, and the assertions run in pytest.
"""

import pytest
import torch
from torch import nn

from parallelisms.comm import Comms
from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.parallel.data import DataParallel
from parallelisms.training import RunSpec, train_rank
from parallelisms.equivalence import reference_train

from _launching import settled

MODEL = preset("tiny")
BASE = TrainConfig(steps=5, global_batch=16, seq_len=32)
SCENARIOS = {  # name: (train config, trace)
    "one_bucket": (BASE.replace(bucket_mb=100.0), False),
    "many_buckets": (BASE.replace(bucket_mb=0.01), True),
    "grad_accum": (BASE.replace(grad_accum=2, bucket_mb=0.05), False),
}


class _TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).sum()


def _unused_parameter_cases(info, comms):
    out = {}
    torch.manual_seed(0)
    model = _TwoBranches()
    ddp = DataParallel(model, comms, "dp")
    try:
        model(torch.ones(2, 4)).backward()
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    ddp.remove()
    model = _TwoBranches()
    ddp = DataParallel(model, comms, "dp", find_unused_parameters=True)
    model(torch.full((2, 4), float(info.rank + 1))).backward()
    out["unused_grad_zero"] = bool((model.unused.weight.grad == 0).all())
    out["used_weight_grad"] = model.used.weight.grad[0, 0].item()
    return out


class _UsedInReverse(nn.Module):
    """Registered first, used last: its gradients arrive first, against the reverse-registration guess."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.first(self.second(x)).sum()


def _bucket_order_cases(info, comms):
    torch.manual_seed(0)
    model = _UsedInReverse()
    ddp = DataParallel(model, comms, "dp", bucket_cap_mb=1e-6)  # one parameter per bucket
    before = [b.names[0] for b in ddp.buckets]
    for _ in range(2):  # no optimizer: the second step's gradients equal the first's
        ddp.zero_grad()
        model(torch.full((2, 4), float(info.rank + 1))).backward()
    return {"before": before, "after": [b.names[0] for b in ddp.buckets], "grad": model.first.weight.grad.tolist()}


def _run(info, world):
    dims = ParallelDims(dp_replicate=world)
    reports = {name: train_rank(info, RunSpec(MODEL, cfg, ParallelConfig(dims), collect_state=True), trace)
               for name, (cfg, trace) in SCENARIOS.items()}
    comms = Comms(dims.build_meshes())
    reports["unused"] = _unused_parameter_cases(info, comms)
    reports["order"] = _bucket_order_cases(info, comms)
    return reports


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def run(request):
    world = request.param
    return world, launch(_run, world, world, threads=1)[0]


@pytest.fixture(scope="module")
def references():
    return {name: reference_train(MODEL, cfg) for name, (cfg, _) in SCENARIOS.items()}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_reproduces_single_process_training(run, references, scenario):
    _, reports = run
    report = reports[scenario]
    result = settled(report, MODEL, SCENARIOS[scenario][0], references[scenario])
    assert result["ok"], result
    assert result["max_loss_rel_diff"] < 1e-6


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ledger_bytes_equal_ring_all_reduce_of_gradients(run, scenario):
    world, reports = run
    grad_bytes = MODEL.num_params() * 4
    comm = reports[scenario]["comm"]
    assert set(comm) == {"all_reduce"}
    assert comm["all_reduce"]["bytes_per_rank"] == pytest.approx(2 * (world - 1) / world * grad_bytes, rel=1e-12)
    calls = comm["all_reduce"]["calls"]
    if scenario == "one_bucket":
        assert calls == 1
    else:
        assert calls > 5  # many buckets, still one reduction per gradient per step (accumulation is free)


def test_first_bucket_is_issued_before_backward_ends(run):
    _, reports = run
    spans = reports["many_buckets"]["spans"][0]
    backwards = [s for s in spans if s.cat == "compute" and s.name == "backward"]
    backward = backwards[-1]
    inside = [s for s in spans if backward.start <= s.start <= backward.end]
    comms = sorted((s for s in inside if s.cat == "comm"), key=lambda s: s.start)
    waits = [s for s in inside if s.cat == "wait"]
    assert len(comms) > 5 and waits
    # the first all-reduce started while backward was still computing: before the end-of-backward wait
    assert comms[0].start < min(w.start for w in waits) < backward.end
    assert reports["many_buckets"]["overlap_per_rank"][0]["comm_ns"] > 0


def test_unused_parameters(run):
    world, reports = run
    out = reports["unused"]
    assert out["error"].startswith("parameter unused.") and "find_unused_parameters=True" in out["error"]
    assert out["unused_grad_zero"]
    # rank r feeds two rows of (r + 1): d sum(Wx + b) / dW = 2 (r + 1), averaged over the ranks
    assert out["used_weight_grad"] == pytest.approx(2 * sum(range(1, world + 1)) / world)


def test_buckets_are_rebuilt_in_the_observed_gradient_order(run):
    _, reports = run
    order = reports["order"]
    assert order["before"] == ["second.bias", "second.weight", "first.bias", "first.weight"]  # the guess
    assert order["after"][:2] == ["first.bias", "first.weight"] or order["after"][:2] == ["first.weight",
                                                                                         "first.bias"]
    assert set(order["after"]) == set(order["before"])
    world = run[0]
    torch.manual_seed(0)
    model = _UsedInReverse()
    for rank in range(world):  # the average gradient, computed in one process
        model(torch.full((2, 4), float(rank + 1))).backward()
    assert torch.allclose(torch.tensor(order["grad"]), model.first.weight.grad / world, atol=1e-6)


@pytest.mark.fast
def test_bucket_cut_in_ready_order_with_an_optional_smaller_first_bucket():
    from parallelisms.parallel.data import _buckets_in_ready_order
    params = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate([100, 100, 300, 300, 300])]
    one_rank = Comms()["dp"]
    names = lambda buckets: [b.names for b in buckets]  # noqa: E731
    # fp32: 400, 400, 1200, 1200, 1200 bytes under a 2400-byte cap
    assert names(_buckets_in_ready_order(params, 2400, lambda p: one_rank)) == [["p0", "p1", "p2"], ["p3", "p4"]]
    assert names(_buckets_in_ready_order(params, 2400, lambda p: one_rank, first_cap_bytes=800)) == [
        ["p0", "p1"], ["p2", "p3"], ["p4"]]


@pytest.mark.fast
@pytest.mark.parametrize("shape", [
    {},
    {"qkv_bias": True, "out_bias": True, "qk_norm": True, "mlp": "gelu"},
    {"tie_embeddings": True},
    {"n_experts": 4, "top_k": 2},
])
@pytest.mark.parametrize("bucket_mb", [0.005, 0.02, 25.0])
def test_the_performance_models_buckets_are_the_runtimes(shape, bucket_mb):
    """DDP's buckets and the ones the step model counts come from one plan, ``wrap.gradient_buckets``, over the
    parameters in reverse registration order: the step model's parameter sizes (perf/buckets.py), cut by it, are
    the buckets DataParallel builds over the real model."""
    import dataclasses

    from parallelisms.model import build_model
    from parallelisms.parallel.wrap import gradient_buckets
    from parallelisms.perf.buckets import module_parameters

    cfg = dataclasses.replace(MODEL, **shape)
    ddp = DataParallel(build_model(cfg), Comms(), "dp", bucket_cap_mb=bucket_mb)
    runtime = [[p.numel() for p in bucket.params] for bucket in ddp.buckets]
    ddp.remove()
    params = module_parameters(cfg, ParallelConfig(), cfg.n_layers, True, True)[::-1]
    cut = gradient_buckets([4 * n for n, _ in params], int(bucket_mb * 2**20), [group for _, group in params])
    assert len(runtime) > (1 if bucket_mb < 1 else 0)
    assert [[params[i][0] for i in bucket] for bucket in cut] == runtime
