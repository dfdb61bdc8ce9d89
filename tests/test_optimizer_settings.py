"""AdamW's settings as flags (``--weight-decay --betas --eps --decay-all``), weight decay on the matrices only by
default, in every engine: a flat shard holding matrices and norms side by side decays only its matrices' runs,
and ZeRO-2 and buffer-reuse FSDP (whose shards straddle both kinds), per-parameter FSDP and DDP reproduce the
single-process reference in float64 within 1e-10 under non-default settings. The export dtype
(``--export-dtype``), and ``--resume DIR`` on a ``--save`` directory (its newest complete checkpoint)."""

import json

import pytest
import torch

from _launching import launch_reports, settled
from parallelisms.cli import main
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.optim import decays, sharded_optimizer
from parallelisms.parallel.placement import flat_pieces
from parallelisms.training import RunSpec
from parallelisms.equivalence import TOLERANCE_FLOAT64, reference_train

MODEL = ModelConfig()
TRAIN = TrainConfig(steps=3, global_batch=4, seq_len=32, dtype="float64", weight_decay=0.1, betas=(0.8, 0.99),
                    eps=1e-6)


def test_which_parameters_decay():
    assert decays("layers.0.attention.wq.weight", 2, TRAIN) and decays("output.weight", 2, TRAIN)
    assert not decays("layers.0.ffn_norm.weight", 1, TRAIN) and not decays("tok_embeddings.weight", 2, TRAIN)
    assert not decays("output.weight", 2, TRAIN, tied=True)
    assert all(decays(n, 1, TRAIN.replace(decay_all=True)) for n in ("norm.weight", "tok_embeddings.weight"))


def test_a_flat_shard_decays_only_its_matrices_elements():
    """A flat parameter [matrix 4x3 | norm 3 | matrix 2x3] steps as torch AdamW steps the three parameters in
    their two groups."""
    torch.manual_seed(0)
    parts = [torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64),
             torch.randn(2, 3, dtype=torch.float64)]
    names = ["layers.0.attention.wq.weight", "layers.0.ffn_norm.weight", "output.weight"]
    flat = torch.nn.Parameter(torch.cat([p.reshape(-1) for p in parts]))
    pieces = flat_pieces(names, [p.shape for p in parts], [()] * 3, None, 0, flat.numel())
    optimizer = sharded_optimizer([(flat, pieces)], TRAIN.replace(lr=0.1))
    assert [len(g["params"]) for g in optimizer.param_groups] == [0, 0, 1]  # decayed, not, by runs
    assert optimizer.param_groups[2]["decay_runs"] == [[(0, 12), (15, 21)]]
    separate = [torch.nn.Parameter(p.clone()) for p in parts]
    reference = torch.optim.AdamW([{"params": [separate[0], separate[2]]},
                                   {"params": [separate[1]], "weight_decay": 0.0}],
                                  lr=0.1, betas=TRAIN.betas, eps=TRAIN.eps, weight_decay=TRAIN.weight_decay)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in parts]
        flat.grad = torch.cat([g.reshape(-1) for g in grads])
        for p, g in zip(separate, grads):
            p.grad = g
        optimizer.step()
        reference.step()
    assert torch.allclose(flat.detach(), torch.cat([p.detach().reshape(-1) for p in separate]), rtol=0, atol=1e-15)


def test_the_flags_change_the_reference():
    base = reference_train(MODEL, TRAIN.replace(weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8))
    for changed in (TRAIN, TRAIN.replace(weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8, decay_all=True)):
        other = reference_train(MODEL, changed)
        assert max((other.state[n] - base.state[n]).abs().max().item() for n in base.state) > 1e-6


LAYOUTS = {
    "dp2 zero2": ParallelConfig(dims=ParallelDims(dp_shard=2), zero=2),  # one bucket: the whole model, one shard
    "dp2 fsdp reuse": ParallelConfig(dims=ParallelDims(dp_shard=2), fsdp="full_shard", fsdp_style="reuse"),
    "dp2 fsdp per_param": ParallelConfig(dims=ParallelDims(dp_shard=2), fsdp="full_shard", fsdp_style="per_param"),
    "dp2": ParallelConfig(dims=ParallelDims(dp_replicate=2)),
}
SETTINGS = {name: TRAIN for name in LAYOUTS} | {"dp2 zero1 --decay-all": TRAIN.replace(decay_all=True)}
PARALLEL = LAYOUTS | {"dp2 zero1 --decay-all": ParallelConfig(dims=ParallelDims(dp_shard=2), zero=1)}
_reports = launch_reports({name: RunSpec(MODEL, SETTINGS[name], PARALLEL[name], collect_state=True)
                           for name in PARALLEL})


@pytest.mark.parametrize("name", PARALLEL)
def test_every_engine_decays_as_the_reference_does(name):
    result = settled(_reports(name), MODEL, SETTINGS[name], splits=2, tolerance=TOLERANCE_FLOAT64)
    assert result["ok"], result


def _refused(argv, capsys) -> str:
    """The one line ``main`` prints for ``argv`` (exit status 2, nothing launched)."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_bad_optimizer_flags_are_one_line(capsys):
    for flags in (["--betas", "0.9"], ["--betas", "0.9,1.5"], ["--eps", "0"], ["--weight-decay", "-1"]):
        assert flags[0] in _refused(["train", *flags], capsys)


def _small(*flags):
    return ["train", "--dp", "1", "--steps", "2", "--global-batch", "2", "--seq-len", "16", *flags]


def test_export_dtypes(tmp_path, capsys):
    from safetensors.torch import load_file

    from parallelisms.hf import export_hf, load_hf

    state = {n: p.detach() for n, p in build_model(MODEL).named_parameters()}
    out = export_hf(state, MODEL, tmp_path / "bf16", torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    transformers = pytest.importorskip("transformers")
    assert transformers.LlamaForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    for flags, dtype in ((["--export-dtype", "same"], torch.float64), ([], torch.float32)):
        out = tmp_path / f"f64{len(flags)}"
        assert main(_small("--dtype", "float64", "--export-hf", str(out), *flags)) == 0
        assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {dtype}
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(dtype)[6:]
    _, again = load_hf(tmp_path / "f642", torch.float64)
    assert again["norm.weight"].dtype == torch.float64
    assert "--export-dtype same applies to --export-hf" in _refused(_small("--export-dtype", "same"), capsys)


def test_resume_from_a_save_directory_takes_its_newest_step(tmp_path, capsys):
    save = tmp_path / "run"
    assert main(_small("--save", str(save), "--save-every", "1")) == 0
    assert sorted(p.name for p in save.glob("step_*")) == ["step_1", "step_2"]
    (save / "step_3").mkdir()  # an incomplete save: skipped
    capsys.readouterr()
    assert main(_small("--resume", str(save), "--steps", "3", "--json")) == 0
    out = capsys.readouterr().out
    assert f"resuming from {save / 'step_2'}" in out
    assert json.loads(out.splitlines()[-1])["first_step"] == 3
    err = _refused(_small("--resume", str(save), "--steps", "3", "--weight-decay", "0.1"), capsys)
    assert "weight_decay 0.01, this run has 0.1" in err


def test_the_api_takes_the_settings():
    from parallelisms.api import configure

    cfg = configure(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, decay_all=True, tie_embeddings=True)
    assert (cfg.train.betas, cfg.train.eps, cfg.train.weight_decay, cfg.train.decay_all) == ((0.8, 0.99), 1e-6, 0.1, True)
    assert cfg.model.tie_embeddings
