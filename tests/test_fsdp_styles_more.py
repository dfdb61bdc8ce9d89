"""The per-parameter (FSDP2) and buffer-reuse (YaFSDP) engines with bf16 mixed precision, full recomputation
and expert parallelism, plain and held through pipeline steps, against single-process training:

- bf16 at dp 2 and at pp 2 x dp 2 (held: fp32 main grads over the microbatches) against single-process bf16
  training on the same batch slices (bf16 weights and compute, fp32 master weights, each slice's bf16 gradient
  summed in fp32) within TOLERANCE: the same arithmetic; and far from fp32 training, so bf16 really ran;
- full recomputation at dp 2 (with clipping that bites, too) and at pp 2 x dp 2, in float64 at
  TOLERANCE_FLOAT64; and, in one process, recomputation keeps less memory through backward and computes the
  same gradients;
- tiny-moe with expert parallelism at dp 2 x ep 2, dp 4 x ep 2 with clipping (expert weights sharded over
  ep_replicate 2) and pp 2 x dp 2 x ep 2, in float64 at TOLERANCE_FLOAT64.

One launch per world size trains its scenarios in sequence (process start-up dominates on two cores).
"""

import ctypes
import gc

import pytest
import torch

from parallelisms.comm import Comms
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig, preset
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.support import validate_layout
from parallelisms.training import RunSpec, parallelize
from parallelisms.equivalence import TOLERANCE, TOLERANCE_FLOAT64, batch_slices, compare, reference_train, reference_train_bf16

from _launching import assert_reproduces, launch_reports, one_thread

TINY, MOE = preset("tiny"), preset("tiny-moe")
PIPE = ModelConfig(vocab_size=256, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
F64 = TrainConfig(steps=2, global_batch=8, seq_len=16, grad_clip=0.0, dtype="float64")
CLIP = F64.replace(grad_clip=0.5)  # below every step's reference norm: asserted below
BF16 = F64.replace(dtype="float32")
STYLES = ("per_param", "reuse")


def _layout(style: str, pp: int = 1, dp: int = 2, ep: int = 1, **options) -> ParallelConfig:
    pipeline = {"schedule": "1f1b", "microbatches": 2} if pp > 1 else {}
    return ParallelConfig(ParallelDims(pp=pp, dp_shard=dp, ep=ep), fsdp="full_shard", fsdp_style=style,
                          **pipeline, **options)


SCENARIOS = {}  # name -> (model, train, layout)
for _s in STYLES:
    SCENARIOS |= {
        f"{_s}_dp2_bf16": (TINY, BF16, _layout(_s, mixed_precision="bf16")),
        f"{_s}_pp2_dp2_bf16": (PIPE, BF16, _layout(_s, pp=2, mixed_precision="bf16")),
        f"{_s}_dp2_recompute": (TINY, F64, _layout(_s, recompute="full")),
        f"{_s}_dp2_recompute_clip": (TINY, CLIP, _layout(_s, recompute="full")),
        f"{_s}_pp2_dp2_recompute": (PIPE, F64, _layout(_s, pp=2, recompute="full")),
        f"{_s}_dp2_ep2": (MOE, F64, _layout(_s, ep=2)),
        f"{_s}_dp4_ep2_clip": (MOE, CLIP, _layout(_s, dp=4, ep=2)),
        f"{_s}_pp2_dp2_ep2": (MOE, F64, _layout(_s, pp=2, ep=2)),
    }
SPECS = {name: RunSpec(model, train, validate_layout(model, train, parallel), collect_state=True)
         for name, (model, train, parallel) in SCENARIOS.items()}


_report = launch_reports(SPECS)


@pytest.mark.parametrize("name", [n for n in SCENARIOS if not n.endswith("bf16")])
def test_reproduces_single_process_float64(name):
    model, train, parallel = SCENARIOS[name]
    with one_thread():
        assert_reproduces(_report(name), model, train, batch_slices(parallel, train), TOLERANCE_FLOAT64)


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.endswith("bf16")])
def test_bf16_is_single_process_bf16_arithmetic(name):
    model, train, parallel = SCENARIOS[name]
    with one_thread():
        twin = compare(_report(name), reference_train_bf16(model, train, splits=batch_slices(parallel, train)), TOLERANCE)
        fp32 = compare(_report(name), reference_train(model, train, splits=batch_slices(parallel, train)), TOLERANCE)
    assert twin["ok"], twin
    assert fp32["max_param_rel_diff"] > 100 * TOLERANCE, fp32  # bf16 rounding: weights and compute were bf16


def test_expert_weights_are_sharded_over_the_ranks_holding_the_same_experts():
    """At dp 4 x ep 2 each expert weight is held by ep_replicate 2 ranks, so each keeps half of its rows:
    persistent parameters are half the rank's share of the model (n_experts / ep experts, every dense weight)."""
    numel = {n: p.numel() for n, p in build_model(MOE, 0, device="meta").named_parameters()}
    experts = sum(v for n, v in numel.items() if ".experts." in n) // 2   # this rank's experts
    dense = sum(v for n, v in numel.items() if ".experts." not in n)
    for style in STYLES:
        memory = _report(f"{style}_dp4_ep2_clip")["memory"]
        assert memory["params"] == 8 * (dense // 4 + experts // 2), style  # float64, no padding here


def _heap_in_use() -> int:
    """Bytes the C allocator has handed out (glibc's mallinfo2: small blocks and mmapped ones)."""
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.parametrize("style", STYLES)
def test_full_recompute_keeps_less_through_backward_and_computes_the_same(style):
    """In one process (one-rank mesh) on a model whose activations dominate: the heap in use at the end of
    forward (what backward will need) drops to below half with --recompute full, and the gradient shards are
    bitwise those without recomputation (the recomputed forward saw the same weights)."""
    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=256, max_seq_len=256)
    tokens = torch.randint(0, 256, (8, 257), generator=torch.Generator().manual_seed(0))
    kept, grads = {}, {}
    for mode in ("none", "full", "none"):  # none twice: the second, after the allocator has warmed up, counts
        trainer = parallelize(build_model(cfg, 0), ParallelConfig(fsdp="full_shard", fsdp_style=style, recompute=mode),
                              TrainConfig(), Comms())
        model, sync = trainer.forward_backward.model, trainer.grad_sync
        sync.zero_grad()
        gc.collect()  # the last round's trainer and graph are gone before, and nothing is collected during, forward
        gc.disable()
        try:
            before = _heap_in_use()
            loss = model(tokens[:, :-1], tokens[:, 1:])
            kept[mode] = _heap_in_use() - before
        finally:
            gc.enable()
        loss.backward()
        grads[mode] = [p.grad.clone() for p in sync.parameters()]
        del trainer, model, sync, loss
    assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads["full"]))
    assert 0 < kept["full"] < 0.5 * kept["none"], kept
