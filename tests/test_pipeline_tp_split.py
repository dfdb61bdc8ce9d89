"""Tensor parallelism under the split-backward schedules (Zero Bubble, Qi et al. 2024), DualPipe(V) and
PipeDream: the tensor-parallel layers leave their weight-gradient work in the W-store while it defers, and
flushing it puts each gradient where autograd would have (a leaf's ``.grad``, or its region of a flat leaf
buffer's ``.grad`` for a view); every schedule at pp 2 x tp 2 (with SP, the overlapped input gradient,
clipping, and PipeDream's per-stage clipping summed over tp) reproduces single-process training in float64.

One launch of four ranks runs every scenario in sequence (process start-up dominates on two cores).
"""

import dataclasses
import functools

import pytest
import torch

from parallelisms.comm import Comm
from parallelisms.config import PRESETS, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.parallel.pipeline.executor import WeightGradStore, _SplitLinearFn, split_linears
from parallelisms.parallel.pipeline.pipedream import pipedream_reference
from parallelisms.parallel.tensor import Region, _ColumnParallel, _RowParallel
from parallelisms.parallel.tensor_plan import apply_tensor_parallel
from parallelisms.support import validate_layout
from parallelisms.training import RunSpec
from parallelisms.equivalence import TOLERANCE_FLOAT64, Run, compare, reference_train

from _launching import launch_once_per_world, one_thread, train_each

# -- the W-store: deferral and flush -------------------------------------------------------------------------


def _f64(*shape, grad=False):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=grad)


def _autograd_grads(run, *leaves):
    """The gradients of ``leaves`` that plain autograd gives for ``run()``'s summed output."""
    torch.autograd.backward([out.sum() for out in run()])
    grads = [leaf.grad.clone() for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    return grads


def _deferred_grads(store, run, *leaves):
    """The same, with the weight gradients deferred under one key: none lands before the flush."""
    with store.deferring((0, 0)):
        torch.autograd.backward([out.sum() for out in run()])
    assert store.pending[(0, 0)], "nothing was deferred"
    before = [leaf.grad for leaf in leaves]
    store.flush((0, 0))
    assert not store.pending
    return before, [leaf.grad for leaf in leaves]


@pytest.mark.fast
def test_flush_accumulates_into_the_region_of_a_flat_leaf_buffer():
    """Two weights attached as views of one flat leaf (the flat engine's ``unit.full``): the flush adds each
    gradient into its region of the buffer's ``.grad`` (allocated as zeros), exactly autograd's result, and
    a second flush accumulates."""
    torch.manual_seed(0)
    flat, x = _f64(3 + 4 * 5 + 2 + 5 * 6, grad=True), _f64(2, 3, 6)
    first, second = flat[3:23].view(4, 5), flat[25:].view(5, 6)  # gaps: nothing may land there

    def run():
        return [_SplitLinearFn.apply(_SplitLinearFn.apply(x, second, store), first, store)]
    store = WeightGradStore()
    expected, = _autograd_grads(run, flat)
    assert store.can_defer(first) is False  # outside a deferring block
    before, (after,) = _deferred_grads(store, run, flat)
    assert before == [None]
    assert torch.equal(after, expected)
    assert not after[:3].any() and not after[23:25].any()
    _deferred_grads(store, run, flat)
    assert torch.equal(flat.grad, 2 * expected)


@pytest.mark.fast
def test_weights_computed_in_forward_are_not_deferred():
    """A leaf and a view of a leaf defer; a computed weight (a gathered, narrowed KV weight) does not: its
    gradient flows on through autograd to its leaf at once."""
    store, leaf = WeightGradStore(), _f64(4, 3, grad=True)
    with store.deferring((0, 0)):
        assert store.can_defer(leaf) and store.can_defer(leaf[1:3])
        assert not store.can_defer((leaf * 2)[1:3])
        assert not store.can_defer(_f64(4, 3))  # no gradient wanted
    x = _f64(2, 3)

    def run():
        return [_SplitLinearFn.apply(x, (leaf * 2)[1:3], store)]
    expected, = _autograd_grads(run, leaf)
    with store.deferring((0, 0)):
        run()[0].sum().backward()
    assert store.pending == {(0, 0): []} and torch.equal(leaf.grad, expected)


@pytest.mark.parametrize("sequence_parallel, overlap", [(False, False), (True, True)])
@pytest.mark.fast
def test_tensor_parallel_layers_defer_their_weight_gradients(sequence_parallel, overlap):
    """A column region (two weights, one computed) feeding a row-parallel layer, on a one-rank region holding
    the store: the input gradient is complete after the deferred backward, the leaf weights' gradients appear
    only at the flush and equal autograd's, the computed weight's leaf gets its gradient at once."""
    torch.manual_seed(0)
    region = Region(Comm("tp"), sequence_parallel, overlap)
    x, wq, kv, wo = _f64(2, 3, 4, grad=True), _f64(6, 4, grad=True), _f64(4, 4, grad=True), _f64(4, 6, grad=True)

    def run():
        q, k = _ColumnParallel.apply(x, region, wq, (kv * 1.0).narrow(0, 0, 2))
        return [_RowParallel.apply(q, wo, region), k]
    expected = _autograd_grads(run, x, wq, kv, wo)
    region.store = WeightGradStore()
    before, after = _deferred_grads(region.store, run, x, wq, kv, wo)
    assert [g is None for g in before] == [False, True, False, True]
    assert torch.equal(before[0], expected[0]) and torch.equal(before[2], expected[2])
    for got, want in zip(after, expected):
        torch.testing.assert_close(got, want, rtol=TOLERANCE_FLOAT64, atol=0)


@pytest.mark.fast
def test_split_linears_hands_the_store_to_every_tensor_parallel_region():
    model = build_model(PRESETS["tiny"], seed=0, dtype=torch.float64)
    apply_tensor_parallel(model, Comm("tp"), sequence_parallel=True)
    store = WeightGradStore()
    split_linears(model, store)
    regions = [m.region for m in model.modules() if isinstance(getattr(m, "region", None), Region)]
    assert len(regions) > 2 * PRESETS["tiny"].n_layers and all(r.store is store for r in regions)


# -- every schedule at pp 2 x tp 2 against single-process training in float64 ------------------------------

MODEL = dataclasses.replace(PRESETS["tiny"], n_layers=4)  # the V schedules need pp x 2 stages
TRAIN = TrainConfig(steps=2, global_batch=4, seq_len=16, grad_clip=0.0, dtype="float64")
CLIP = TRAIN.replace(grad_clip=0.5)  # below every step's norm (asserted): the clip scales every step

# name -> (schedule, sequence parallel, overlapped input gradient, train config)
SCENARIOS = {
    "zb-h1": ("zb-h1", False, False, TRAIN),
    "zb-h2_sp_overlap_clip": ("zb-h2", True, True, CLIP),
    "zb-v_sp_clip": ("zb-v", True, False, CLIP),
    "dualpipe_clip": ("dualpipe", False, False, CLIP),
    "dualpipev_sp": ("dualpipev", True, False, TRAIN),
    "dualpipev_overlap": ("dualpipev", False, True, TRAIN),
    "pipedream_sp_clip": ("pipedream", True, False, CLIP),
}
MICROBATCHES = 4  # even, as DualPipe needs: one row each


def _spec(name: str) -> RunSpec:
    schedule, sp, overlap, train = SCENARIOS[name]
    parallel = ParallelConfig(ParallelDims(pp=2, tp=2), schedule=schedule, microbatches=MICROBATCHES,
                              sequence_parallel=sp, tp_overlap=overlap)
    return RunSpec(MODEL, train, validate_layout(MODEL, train, parallel), collect_state=True)


SPECS = {name: _spec(name) for name in SCENARIOS}
results = launch_once_per_world(functools.partial(train_each, specs=SPECS))


@functools.cache
def _reference(schedule: str, train: TrainConfig) -> Run:
    """Single-process training on the microbatches' slices, or PipeDream's delayed-update reference."""
    with one_thread():
        if schedule == "pipedream":
            return Run(*pipedream_reference(MODEL, train, 2, MICROBATCHES))
        return reference_train(MODEL, train, splits=MICROBATCHES)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_float64_matches_single_process(name):
    schedule, _, _, train = SCENARIOS[name]
    report, reference = results(4)[name], _reference(schedule, train)
    result = compare(report, reference, TOLERANCE_FLOAT64)
    assert result["ok"], (name, result)
    assert (result["max_grad_norm_rel_diff"] is None) == (schedule == "pipedream"), (name, result)
    if train.grad_clip:  # the clip scaled every step, and it changed the training
        if schedule != "pipedream":
            assert min(reference.grad_norms) > 2 * train.grad_clip, reference.grad_norms
        unclipped = compare(report, _reference(schedule, train.replace(grad_clip=0.0)))
        assert unclipped["max_param_rel_diff"] > 1e-3, (name, unclipped)
