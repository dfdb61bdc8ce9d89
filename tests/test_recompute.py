"""Activation recomputation: the same training, with less activation memory kept for backward."""


import pytest
import torch

from parallelisms.cli import main
from parallelisms.config import ModelConfig
from parallelisms.model import build_model
from parallelisms.parallel.recompute import apply_recompute


def saved_activation_bytes(model, tokens) -> int:
    """Bytes of distinct storages autograd keeps for backward during one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return sum(seen.values())


def test_recompute_keeps_less_and_computes_the_same():
    cfg = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=256, max_seq_len=256)
    tokens = torch.randint(0, 256, (2, 129), generator=torch.Generator().manual_seed(0))
    kept, grads = {}, {}
    for mode in ("none", "selective", "full"):
        model = apply_recompute(build_model(cfg, seed=0), mode)
        kept[mode] = saved_activation_bytes(model, tokens)
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for mode in ("selective", "full"):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads["none"], grads[mode])), mode
    assert kept["full"] < kept["selective"] < kept["none"]
    assert kept["full"] < 0.4 * kept["none"]  # reported in docs/architecture.md
    with pytest.raises(ValueError, match="unknown recompute mode"):
        apply_recompute(build_model(cfg), "most")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_verify_with_recompute(capsys, mode):
    assert main(["verify", "--dp", "2", "--recompute", mode, "--steps", "3"]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")


@pytest.mark.parametrize("style, recompute", [("flat", "full"), ("flat", "selective"), ("per_param", "selective"),
                                              ("reuse", "selective"), ("per_param", "full"), ("reuse", "full")])
def test_every_fsdp_style_recomputes_when_asked(style, recompute, monkeypatch):
    """parallelize applies recomputation before the gradient sync whatever the sync is, so the recomputed
    attention core runs again in backward (the per-parameter and reuse styles used to return before
    recomputation was applied, training without recomputing anything)."""
    import torch.nn.functional as F

    from parallelisms.comm import Comms
    from parallelisms.config import ParallelConfig, TrainConfig, preset
    from parallelisms.training import parallelize

    calls, attention = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or attention(*a, **k))

    def attention_calls(mode: str) -> int:
        calls.clear()
        trainer = parallelize(build_model(preset("tiny"), 0),
                              ParallelConfig(fsdp="full_shard", fsdp_style=style, recompute=mode), TrainConfig(), Comms())
        tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
        trainer.train_step(tokens, tokens)
        return len(calls)
    assert attention_calls("none") == preset("tiny").n_layers
    assert attention_calls(recompute) == 2 * preset("tiny").n_layers


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipe", "dualpipev")
DEEP = ModelConfig(vocab_size=256, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)


def _recompute_specs():
    from parallelisms.config import ParallelConfig, TrainConfig
    from parallelisms.mesh import ParallelDims
    from parallelisms.support import validate_layout
    from parallelisms.training import RunSpec

    train = TrainConfig(steps=2, global_batch=8, seq_len=16, dtype="float64")
    specs = {}
    for schedule in SCHEDULES:
        mode = "selective" if schedule == "zb-h2" else "full"
        parallel = ParallelConfig(ParallelDims(pp=2), schedule=schedule, recompute=mode,
                                  chunks=2 if schedule == "interleaved" else 1)
        specs[schedule] = RunSpec(DEEP, train, validate_layout(DEEP, train, parallel), collect_state=True)
    return specs


def _run_schedules(info, world):
    from _launching import train_each
    return train_each(info, world, _recompute_specs())


@pytest.fixture(scope="module")
def schedule_runs():
    from parallelisms.launch import launch
    return launch(_run_schedules, 2, 2, threads=1)[0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_recompute_with_every_schedule_matches_in_float64(schedule_runs, schedule):
    """Blocks recomputed in backward under every synchronous schedule, split backward and DualPipe's
    copies included (the deferred weight gradient lands on the parameter, not on the alias a recomputed
    forward saves), match single-process training in float64."""
    from parallelisms.equivalence import TOLERANCE_FLOAT64, compare, reference_train

    spec = _recompute_specs()[schedule]
    result = compare(schedule_runs[schedule], reference_train(DEEP, spec.train, splits=4), TOLERANCE_FLOAT64)
    assert result["ok"], result
