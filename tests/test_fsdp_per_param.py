"""Per-parameter sharding (FSDP2 style) and buffer reuse (YaFSDP style) reproduce single-process AdamW,
keep the model's Parameter objects (per_param: the optimizer's too), and (reuse) allocate exactly two
weight and two gradient buffers.

All scenarios of one world size run in one launch (process start-up dominates on two cores).
"""

import pytest
import torch

from parallelisms.support import validate_layout
from parallelisms.comm import Comms
from parallelisms.config import ConfigError, ParallelConfig, TrainConfig, preset
from parallelisms.launch import launch
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.training import RunSpec, parallelize, train_rank
from parallelisms.equivalence import reference_train

from _launching import settled

MODEL = preset("tiny")
BASE = TrainConfig(steps=3, global_batch=16, seq_len=32)
SCENARIOS = {  # name: (fsdp strategy, style, train config)
    "per_param": ("full_shard", "per_param", BASE.replace(grad_accum=2)),
    "per_param_shard_grad_op": ("shard_grad_op", "per_param", BASE),
    "reuse": ("full_shard", "reuse", BASE.replace(grad_accum=2)),
}


def _identity(world: int, comms: Comms, style: str) -> dict:
    """The model keeps its own Parameter objects and plain state_dict keys; the optimizer holds them
    (per_param) or one flat shard per unit (reuse, as YaFSDP)."""
    model = build_model(MODEL, 0)
    before = [id(p) for p in model.parameters()]
    plain_keys = list(build_model(MODEL, 0).state_dict())
    parallel = ParallelConfig(ParallelDims(dp_shard=world), fsdp="full_shard", fsdp_style=style)
    trainer = parallelize(model, parallel, BASE, comms)
    held = [id(p) for group in trainer.optimizer.param_groups for p in group["params"]]
    inputs = torch.randint(0, MODEL.vocab_size, (2, 16))
    trainer.train_step(inputs, inputs)
    grads_are_views = all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    trainer.grad_sync.remove()
    expected = before if style == "per_param" else [id(u.flat_param) for u in trainer.grad_sync.units]
    return {"same_objects": before == [id(p) for p in model.parameters()] and sorted(held) == sorted(expected),
            "keys_equal": list(model.state_dict()) == plain_keys, "grads_shard_shaped": grads_are_views,
            "sharded_numel": sum(p.numel() for p in model.parameters())}


def _run(info, world):
    dims = ParallelDims(dp_shard=world)
    out = {}
    for name, (strategy, style, cfg) in SCENARIOS.items():
        spec = RunSpec(MODEL, cfg, ParallelConfig(dims, fsdp=strategy, fsdp_style=style), collect_state=True)
        out[name] = train_rank(info, spec)
    comms = Comms(dims.build_meshes())
    out["identity"] = {style: _identity(world, comms, style) for style in ("per_param", "reuse")}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def run(request):
    world = request.param
    return world, launch(_run, world, world, threads=1)[0]


@pytest.fixture(scope="module")
def references():
    configs = {cfg for _, _, cfg in SCENARIOS.values()}
    return {cfg: reference_train(MODEL, cfg) for cfg in configs}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_reproduces_single_process_adamw(run, references, scenario):
    _, reports = run
    result = settled(reports[scenario], MODEL, SCENARIOS[scenario][2], references[SCENARIOS[scenario][2]])
    assert result["ok"], result


@pytest.mark.parametrize("style", ["per_param", "reuse"])
def test_parameter_identity_and_state_dict_keys(run, style):
    world, reports = run
    identity = reports["identity"][style]
    assert identity["same_objects"] and identity["keys_equal"] and identity["grads_shard_shaped"]
    assert identity["sharded_numel"] <= -(-MODEL.num_params() // world) + 64 * world  # padding only


def test_reuse_keeps_two_weight_and_two_gradient_buffers(run):
    _, reports = run
    memory = reports["reuse"]["memory"]
    assert memory["buffer_allocations"] == {"weight": 2, "grad": 2}
    assert memory["live_buffers"] == {"weight": 2, "grad": 2}
    per_param = reports["per_param"]["memory"]
    assert per_param["live_buffers"] == {"weight": 0, "grad": 0}  # everything gathered was freed
    assert per_param["buffer_allocations"]["weight"] > 2 * (MODEL.n_layers + 2)  # fresh buffers every gather


def test_full_shard_gathers_blocks_again_in_backward(run):
    """FULL_SHARD all-gathers the blocks once more in backward; SHARD_GRAD_OP does not; the last unit (head)
    and the embedding (whose backward needs no weight) are not gathered again; reuse skips the last block too."""
    world, reports = run
    calls = {name: round(reports[name]["comm"]["all_gather"]["calls"], 6) for name in SCENARIOS}
    units = MODEL.n_layers + 2
    assert calls["per_param_shard_grad_op"] == units
    assert calls["per_param"] == 2 * (units + MODEL.n_layers)
    assert calls["reuse"] == 2 * (units + MODEL.n_layers - 1)
    assert round(reports["per_param"]["comm"]["reduce_scatter"]["calls"], 6) == 2 * units


@pytest.mark.parametrize("changes, message", [
    ({"fsdp": "no_shard", "fsdp_style": "per_param"}, "runs --fsdp full_shard or shard_grad_op"),
    ({"fsdp": "shard_grad_op", "fsdp_style": "reuse"}, "runs --fsdp full_shard"),
    ({"zero": 3, "fsdp_style": "per_param"}, "--zero 3 with --fsdp-style per_param: two ways to shard"),
    ({"fsdp": "full_shard", "fsdp_style": "dtensor"}, "unknown --fsdp-style"),
])
def test_bad_style_is_one_line_error(changes, message):
    parallel = ParallelConfig(ParallelDims(dp_shard=2), **changes)
    with pytest.raises(ConfigError, match=message) as info:
        validate_layout(MODEL, BASE, parallel)
    assert "\n" not in str(info.value)
