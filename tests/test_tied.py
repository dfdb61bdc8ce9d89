"""Tied embeddings (``tie_word_embeddings``: Llama 3.2 1B/3B, small Qwen2.5) trained as ``transformers`` trains
them: a random tied ``LlamaForCausalLM`` trained in one process with torch AdamW (the same batches, clipping and
optimizer groups) gives the losses and gradient norms that ``--init-from`` gives at every step in dp 2, tp 2 with SP,
pp 2, ZeRO-1/2/3 and every FSDP strategy and style (flat, per-parameter, buffer reuse; hybrid over 2 x 2), and the
export is tied and loads in transformers. Every rank's optimizer holds the weight once and, in one stage, the head
is the embedding's own parameter, sharding engines included; a tied checkpoint resumes in another layout. In float64,
tied layouts (tensor x pipeline x data with and without ZeRO, tensor x data under ZeRO-3, ZeRO under a V-shaped
schedule where one rank holds both ends, buffer reuse) reproduce a truly tied single-process model within 1e-10."""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from _launching import launch_reports, settled  # noqa: E402
from test_hf import random_llama  # noqa: E402
from parallelisms.cli import main  # noqa: E402
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from parallelisms.data.sources import training_loader  # noqa: E402
from parallelisms.hf import export_hf, load_hf  # noqa: E402
from parallelisms.launch import launch  # noqa: E402
from parallelisms.mesh import ParallelDims  # noqa: E402
from parallelisms.optim import decays  # noqa: E402
from parallelisms.training import RunSpec  # noqa: E402
from parallelisms.equivalence import TOLERANCE_FLOAT64, batch_slices, clip_grad_norm_float64  # noqa: E402

STEPS = 4
TRAIN = TrainConfig(steps=STEPS, global_batch=4, seq_len=32, lr=1e-2)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A random tied Llama saved with no lm_head tensor."""
    return random_llama(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)


def _transformers_training(path) -> tuple[list[float], list[float]]:
    """``STEPS`` steps of the tied transformers model with torch AdamW, one process: per-step losses and gradient norms
    (before clipping; summed in float64, as torch's fp32 norm is itself ~5e-6 off here). The groups follow the defaults: no decay on 1-D weights nor on the (tied) embedding."""
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    named = list(model.named_parameters())  # the tied weight once
    ours = {"model.embed_tokens.weight": "tok_embeddings.weight"}
    chosen = [decays(ours.get(n, n), p.dim(), TRAIN) for n, p in named]
    optimizer = torch.optim.AdamW([{"params": [p for (_, p), d in zip(named, chosen) if d]},
                                   {"params": [p for (_, p), d in zip(named, chosen) if not d], "weight_decay": 0.0}],
                                  lr=TRAIN.lr, betas=TRAIN.betas, eps=TRAIN.eps, weight_decay=TRAIN.weight_decay)
    loader = training_loader(TRAIN)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = loader.batch(step)
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        norms.append(clip_grad_norm_float64(list(model.parameters()), TRAIN.grad_clip).item())  # summed in float64
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


def _fsdp(strategy: str, style: str = "flat", dims: ParallelDims = ParallelDims(dp_shard=2)) -> ParallelConfig:
    return ParallelConfig(dims=dims, fsdp=strategy, fsdp_style=style)


LAYOUTS = {
    "dp2": ParallelConfig(dims=ParallelDims(dp_replicate=2)),
    "tp2 +sp": ParallelConfig(dims=ParallelDims(tp=2), sequence_parallel=True),
    "pp2": ParallelConfig(dims=ParallelDims(pp=2)),
    **{f"dp2 zero{k}": ParallelConfig(dims=ParallelDims(dp_shard=2), zero=k) for k in (1, 2, 3)},
    **{f"dp2 fsdp {s}": _fsdp(s) for s in ("full_shard", "shard_grad_op", "no_shard")},
    **{f"dp2 fsdp per_param {s}": _fsdp(s, "per_param") for s in ("full_shard", "shard_grad_op")},
    "dp2 fsdp reuse": _fsdp("full_shard", "reuse"),
    **{f"dp2x2 fsdp {s}": _fsdp(s, dims=ParallelDims(dp_replicate=2, dp_shard=2))
       for s in ("hybrid_shard", "hybrid_shard_zero2")},
}


@pytest.fixture(scope="module")
def reference(tied_dir):
    return _transformers_training(tied_dir)


@pytest.fixture(scope="module")
def tied_runs(tied_dir):
    """name -> rank 0's report of ``STEPS`` ``--init-from`` steps in that layout (one launch per world size)."""
    cfg, start = load_hf(tied_dir)
    assert cfg.tie_embeddings and torch.equal(start["output.weight"], start["tok_embeddings.weight"])
    return launch_reports({name: RunSpec(cfg, TRAIN, parallel, collect_state=True, init_from=str(tied_dir))
                           for name, parallel in LAYOUTS.items()})


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_tied_checkpoint_trains_as_transformers_trains_it(tied_dir, reference, tied_runs, tmp_path, name):
    cfg, _ = load_hf(tied_dir)
    report = tied_runs(name)
    ref_losses, ref_norms = reference
    loss_diff = max(abs(a - b) / b for a, b in zip(report["losses"], ref_losses))
    norm_diff = max(abs(a - b) / b for a, b in zip(report["grad_norms"], ref_norms))
    assert len(report["losses"]) == len(ref_losses) == STEPS
    assert loss_diff < 2e-6 and norm_diff < 1e-5, (name, loss_diff, norm_diff)
    assert max(ref_norms) > TRAIN.grad_clip  # the clip bit
    print(f"{name}: losses within {loss_diff:.1e}, gradient norms within {norm_diff:.1e} of transformers")
    state = report["state"]
    assert torch.allclose(state["output.weight"], state["tok_embeddings.weight"], rtol=0, atol=1e-7)
    out = export_hf(state, cfg, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    from safetensors.torch import load_file
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    inputs, targets = training_loader(TRAIN).batch(0)
    with torch.no_grad():
        theirs = F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()).item()
    again_cfg, again = load_hf(out)
    assert again_cfg == cfg
    from parallelisms.model import build_model
    ours = build_model(cfg)
    ours.load_state_dict(again)
    with torch.no_grad():
        assert abs(ours(inputs, targets).item() - theirs) < 1e-5 * theirs


VERIFY_MODEL = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64,
                           tie_embeddings=True)
VERIFY_TRAIN = TrainConfig(steps=3, global_batch=8, seq_len=32, dtype="float64")
VERIFY = {
    "dp2 x tp2 x pp2 +sp": ParallelConfig(dims=ParallelDims(dp_replicate=2, tp=2, pp=2), sequence_parallel=True),
    "dp2 x tp2 x pp2 zero1 +sp": ParallelConfig(dims=ParallelDims(dp_shard=2, tp=2, pp=2), sequence_parallel=True,
                                                zero=1),
    "dp2 x tp2 zero3 +sp": ParallelConfig(dims=ParallelDims(dp_shard=2, tp=2), sequence_parallel=True, zero=3),
    "dp2 x tp2 fsdp per_param": ParallelConfig(dims=ParallelDims(dp_shard=2, tp=2), fsdp="full_shard",
                                               fsdp_style="per_param"),
    "pp2 x dp2 zero2 zb-v": ParallelConfig(dims=ParallelDims(dp_shard=2, pp=2), zero=2, schedule="zb-v"),
    "dp4 fsdp reuse": ParallelConfig(dims=ParallelDims(dp_shard=4), fsdp="full_shard", fsdp_style="reuse"),
    "pp2 x dp2 dualpipe": ParallelConfig(dims=ParallelDims(dp_replicate=2, pp=2), schedule="dualpipe"),
}
_verify_reports = launch_reports({name: RunSpec(VERIFY_MODEL, VERIFY_TRAIN, parallel, collect_state=True)
                                  for name, parallel in VERIFY.items()})


@pytest.mark.parametrize("name", VERIFY)
def test_tied_layouts_reproduce_a_truly_tied_model_in_float64(name):
    result = settled(_verify_reports(name), VERIFY_MODEL, VERIFY_TRAIN, splits=batch_slices(VERIFY[name], VERIFY_TRAIN),
                     tolerance=TOLERANCE_FLOAT64)
    assert result["ok"], result


ENTRY_LAYOUTS = {  # layout: (parallel config, whether the model's head is the embedding's own parameter)
    "dp2": (ParallelConfig(dims=ParallelDims(dp_replicate=2)), True),
    "tp2 +sp": (ParallelConfig(dims=ParallelDims(tp=2), sequence_parallel=True), True),
    "dp2 zero1": (ParallelConfig(dims=ParallelDims(dp_shard=2), zero=1), True),
    "dp2 zero2": (ParallelConfig(dims=ParallelDims(dp_shard=2), zero=2), True),
    "dp2 zero3": (ParallelConfig(dims=ParallelDims(dp_shard=2), zero=3), True),
    "dp2 fsdp full_shard": (ParallelConfig(dims=ParallelDims(dp_shard=2), fsdp="full_shard"), True),
    "dp2 bf16": (ParallelConfig(dims=ParallelDims(dp_replicate=2), mixed_precision="bf16"), True),
    "dp2 fsdp per_param": (ParallelConfig(dims=ParallelDims(dp_shard=2), fsdp="full_shard", fsdp_style="per_param"),
                           True),
    "dp2 fsdp reuse": (ParallelConfig(dims=ParallelDims(dp_shard=2), fsdp="full_shard", fsdp_style="reuse"), True),
    "pp2": (ParallelConfig(dims=ParallelDims(pp=2)), False),
}


def _optimizer_entries(info, world):
    """Per layout, on this rank: the optimizer parameters holding boxes of the tied weight, whether a box is held
    twice, whether any is named as the head, AdamW's state entries after a step, and whether the head is the
    embedding's own parameter."""
    from parallelisms.comm import Comms
    from parallelisms.model import build_model
    from parallelisms.train_setup import parallelize
    out = {}
    for name, (parallel, _) in ENTRY_LAYOUTS.items():
        model = build_model(VERIFY_MODEL, 0)
        trainer = parallelize(model, parallel, TrainConfig(steps=1, global_batch=4, seq_len=32),
                              Comms(parallel.dims.build_meshes()))
        inputs = torch.randint(0, VERIFY_MODEL.vocab_size, (4 // parallel.dims.dp, 32), generator=torch.Generator())
        trainer.train_step(inputs, inputs.roll(1, 1))
        holders, boxes = 0, []
        for param, pieces in trainer.grad_sync.placements():
            tied = [(pc.name, pc.offsets) for pc in pieces if pc.name in ("tok_embeddings.weight", "output.weight")]
            holders += bool(tied)
            boxes += tied
        steppable = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        out[name] = {"holders": holders, "repeated": len(boxes) != len(set(boxes)),
                     "head_named": any(n == "output.weight" for n, _ in boxes),
                     "state": len(trainer.optimizer.state), "params": len(steppable),
                     "one_parameter": model.output is not None and model.tok_embeddings is not None
                     and model.output.weight is model.tok_embeddings.weight}
        trainer.close()
    return out


def test_the_optimizer_holds_the_tied_weight_once():
    """Every rank that holds the tied weight steps it in one optimizer parameter (the first and last pipeline
    stages each their copy, as Megatron-LM's embedding group): no second entry, no head name in the checkpoint;
    one stage holds it as one model parameter, the sharding engines' head using the embedding's unit (one shard
    set, one gradient: autograd sums the two uses before the reduce-scatter)."""
    ranks = launch(_optimizer_entries, 2, 2, threads=1)
    for name, (_, literal) in ENTRY_LAYOUTS.items():
        for rank in ranks:
            seen = rank[name]
            assert seen["holders"] == 1 and not seen["repeated"] and not seen["head_named"], (name, seen)
            assert seen["state"] == seen["params"], (name, seen)
            assert seen["one_parameter"] == literal, (name, seen)


def test_the_tied_flag_and_pipedream(capsys):
    assert main(["train", "--tie-embeddings", "--pp", "2", "--schedule", "pipedream", "--steps", "1"]) == 2
    assert "tied embeddings with --schedule pipedream" in capsys.readouterr().err
    from parallelisms.cli import build_configs, build_parser
    model, _, _ = build_configs(build_parser().parse_args(["train", "--tie-embeddings"]))
    assert model.tie_embeddings and model.num_params() == ModelConfig().num_params() - 256 * 64


def test_the_performance_model_counts_the_tied_weight_once():
    """A block holds the same parameters tied or not, and one stage's data-parallel traffic is one table."""
    from parallelisms.perf.model import block_params, rank0_params
    import dataclasses
    untied = dataclasses.replace(VERIFY_MODEL, tie_embeddings=False)
    assert block_params(VERIFY_MODEL, 2) == block_params(untied, 2)
    dp2 = ParallelConfig(dims=ParallelDims(dp_replicate=2))
    assert rank0_params(VERIFY_MODEL, dp2) == VERIFY_MODEL.num_params() == untied.num_params() - 256 * 64
    for sharded in (dp2.replace(zero=3), dp2.replace(fsdp="full_shard", fsdp_style="reuse")):  # no head copy either
        assert rank0_params(VERIFY_MODEL, sharded) == VERIFY_MODEL.num_params(), sharded


@pytest.mark.parametrize("save, resume", [("--pp 2", "--dp 2 --zero 3"),
                                          ("--dp 2 --fsdp full_shard --fsdp-style per_param", "--pp 2")])
def test_a_tied_checkpoint_resumes_in_another_layout(capsys, save, resume):
    """Saved by a pipeline (a copy per end, both under the embedding's name), resumed under ZeRO-3; saved by
    per-parameter FSDP (the weight once), resumed by a pipeline (a copy per end)."""
    run = "--tie-embeddings --steps 4 --global-batch 4 --seq-len 16 --dtype float64"
    assert main(["verify-resume", "--save-layout", save, "--resume-layout", resume, "--run", run, "--json"]) == 0
    result = json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1])
    assert result["ok"] and result["max_param_rel_diff"] < TOLERANCE_FLOAT64, result
