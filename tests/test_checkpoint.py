"""Checkpoints (torch.distributed.checkpoint): exact resume in the same layout, resume across layouts, a save that
did not finish, bad input before launch.

Every run is float64, 4 steps, saved after step 2. Same layout: the resumed run's losses and final parameters are
bit-identical to the uninterrupted run's. Another layout: within verify's float64 tolerance (1e-10) of it. One
launch per world size trains the scenarios in order (each save before the resumes that read it).
"""

import atexit
import dataclasses
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from parallelisms.cli import main
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.resume import CheckpointOptions, latest, layout_meta
from parallelisms.support import validate_layout
from parallelisms.training import RunSpec
from parallelisms.equivalence import TOLERANCE_FLOAT64

from _launching import launch_reports

MODEL = ModelConfig(vocab_size=256, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
MOE = dataclasses.replace(MODEL, n_experts=4, top_k=2)
TRAIN = TrainConfig(steps=4, global_batch=8, seq_len=16, dtype="float64", grad_clip=0.5)
SAVE_AT = 2
ROOT = Path(tempfile.mkdtemp(prefix="test-checkpoint-"))
atexit.register(shutil.rmtree, ROOT, True)  # the saves every test reads, removed when the session ends


def _layout(**kw) -> ParallelConfig:
    dims = {k: kw.pop(k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep") if k in kw}
    return ParallelConfig(ParallelDims(**dims), **kw)


SAVED = {  # name -> (model, layout[, train]): trained 4 steps uninterrupted, saving after step 2
    "dp2": (MODEL, _layout(dp_replicate=2)),
    "zero3_dp2": (MODEL, _layout(dp_shard=2, zero=3)),
    "per_param_dp2": (MODEL, _layout(dp_shard=2, fsdp="full_shard", fsdp_style="per_param")),
    "tp2_sp": (MODEL, _layout(tp=2, sequence_parallel=True)),
    "pp2_1f1b": (MODEL, _layout(pp=2, schedule="1f1b", microbatches=2)),
    "pp2_zbv": (MODEL, _layout(pp=2, schedule="zb-v", microbatches=4)),
    "cp2_ring": (MODEL, _layout(cp=2, cp_attention="ring")),
    "ep2": (MOE, _layout(dp_replicate=2, ep=2)),
    "pp2_pipedream": (MODEL, _layout(pp=2, schedule="pipedream", microbatches=4)),
    "zero2_dp2_bf16": (MODEL, _layout(dp_shard=2, zero=2, mixed_precision="bf16"), TRAIN.replace(dtype="float32")),
    "zero3_dp4": (MODEL, _layout(dp_shard=4, zero=3)),
}
CROSS = {  # name -> (saved by, resumed in): together every dimension changes
    "zero3_dp2->tp2_sp": ("zero3_dp2", _layout(tp=2, sequence_parallel=True)),
    "pp2_zbv->fsdp_dp2": ("pp2_zbv", _layout(dp_shard=2, fsdp="full_shard")),
    "cp2_ring->pp2_1f1b": ("cp2_ring", _layout(pp=2, schedule="1f1b", microbatches=2)),
    "tp2_sp->reuse_dp2": ("tp2_sp", _layout(dp_shard=2, fsdp="full_shard", fsdp_style="reuse")),
    "per_param_dp2->cp2_ulysses": ("per_param_dp2", _layout(cp=2, cp_attention="ulysses")),
    "pp2_1f1b->zero1_dp2": ("pp2_1f1b", _layout(dp_shard=2, zero=1)),
    "ep2->moe_tp2": ("ep2", _layout(tp=2)),
    "dp2->pp2_dualpipev": ("dp2", _layout(pp=2, schedule="dualpipev", microbatches=4)),
    "zero3_dp4->tp2_pp2": ("zero3_dp4", _layout(tp=2, pp=2, schedule="1f1b", microbatches=2)),
    "zero3_dp4->hybrid_2x2": ("zero3_dp4", _layout(dp_replicate=2, dp_shard=2, fsdp="hybrid_shard")),
    "zero3_dp2->zero2_dp4": ("zero3_dp2", _layout(dp_shard=4, zero=2)),
}


def _spec(model, parallel, train=TRAIN, **checkpoint) -> RunSpec:
    parallel = validate_layout(model, train, parallel)
    meta = layout_meta(model, train, parallel)
    return RunSpec(model, train, parallel, collect_state=True, checkpoint=CheckpointOptions(meta=meta, **checkpoint))


def _saved_at(name: str) -> str:
    return str(ROOT / name / f"step_{SAVE_AT}")


SPECS = {}
for _name, (_model, _parallel, *_train) in SAVED.items():
    SPECS[_name] = _spec(_model, _parallel, *_train, save_dir=str(ROOT / _name), save_every=SAVE_AT)
    if _parallel.dims.world_size == 2:
        SPECS[f"{_name}/resumed"] = _spec(_model, _parallel, *_train, resume=_saved_at(_name))
# --async-save every step: the next save (and the end of the run) completes the one in flight
SPECS["zero3_dp2_async"] = _spec(MODEL, SAVED["zero3_dp2"][1], save_dir=str(ROOT / "async"), save_every=1,
                                 async_save=True)
SPECS["zero3_dp2_async/resumed"] = _spec(MODEL, SAVED["zero3_dp2"][1], resume=str(ROOT / "async" / "step_2"))
for _name, (_saved, _parallel) in CROSS.items():
    SPECS[_name] = _spec(SAVED[_saved][0], _parallel, resume=_saved_at(_saved))
# the 4-rank launch resumes a 2-rank save: the 2-rank launch runs first (first use, below)
_report = launch_reports(SPECS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def test_saves_are_complete_directories_with_metadata():
    _report("dp2")
    assert sorted(p.name for p in (ROOT / "dp2").iterdir() if p.name != ".parallelisms.lock") == ["step_2", "step_4"]
    meta = json.loads((ROOT / "dp2" / "step_2" / "parallelisms.json").read_text())
    assert meta["step"] == 2 and meta["layout"] == "dp2" and meta["model"]["dim"] == MODEL.dim


@pytest.mark.parametrize("name", [n for n in SAVED if n != "zero3_dp4"])
def test_same_layout_resume_is_bit_identical(name):
    full, resumed = _report(name), _report(f"{name}/resumed")
    assert resumed["first_step"] == SAVE_AT + 1 and len(resumed["losses"]) == TRAIN.steps - SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    assert resumed["grad_norms"] == (full["grad_norms"] and full["grad_norms"][SAVE_AT:])  # None: PipeDream
    for key, tensor in full["state"].items():
        assert torch.equal(resumed["state"][key], tensor), key


def test_async_saves_resume_exactly():
    full, resumed = _report("zero3_dp2"), _report("zero3_dp2_async/resumed")
    assert sorted(p.name for p in (ROOT / "async").iterdir() if p.name != ".parallelisms.lock") == [
        "step_1", "step_2", "step_3", "step_4"]
    assert _report("zero3_dp2_async")["losses"] == full["losses"]
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    for key, tensor in full["state"].items():
        assert torch.equal(resumed["state"][key], tensor), key


@pytest.mark.parametrize("name", list(CROSS))
def test_cross_layout_resume_matches_the_uninterrupted_run(name):
    full, resumed = _report(CROSS[name][0]), _report(name)
    assert resumed["layout"] != full["layout"]
    for a, b in zip(resumed["losses"], full["losses"][SAVE_AT:], strict=True):
        assert abs(a - b) / abs(b) < TOLERANCE_FLOAT64, (resumed["losses"], full["losses"])
    worst = max(_rel(resumed["state"][k], t) for k, t in full["state"].items())
    assert worst < TOLERANCE_FLOAT64, worst


def test_single_process_resumes_a_sharded_save():
    from parallelisms.cli import run_layout
    from parallelisms.device import choose

    full = _report("zero3_dp2")
    resumed = run_layout(_spec(MODEL, ParallelConfig(), resume=_saved_at("zero3_dp2")), choose("cpu", 1))
    assert max(_rel(resumed["state"][k], t) for k, t in full["state"].items()) < TOLERANCE_FLOAT64


def test_a_save_killed_half_way_never_shadows_the_last_complete_one(tmp_path):
    """A killed save leaves ``step_N.tmp`` (DCP's files, no metadata file): ``latest`` and ``--resume auto`` take
    the last complete checkpoint; naming the partial one is refused before launch."""
    _report("dp2")
    root = tmp_path / "run"
    shutil.copytree(ROOT / "dp2", root)
    partial = root / "step_6.tmp"
    shutil.copytree(root / "step_4", partial)
    (partial / "parallelisms.json").unlink()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert latest(root) == root / "step_4"
    argv = ["train", "--dp", "1", "--steps", "5", "--global-batch", "8", "--seq-len", "16", "--config",
            str(_config_json(tmp_path)), "--dtype", "float64", "--grad-clip", "0.5", "--save", str(root),
            "--resume", "auto", "--json"]
    assert main(argv) == 0
    assert latest(root) == root / "step_5"


def _config_json(tmp_path) -> Path:
    """MODEL as a Hugging Face config.json (the CLI's way to name a model shape)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"vocab_size": MODEL.vocab_size, "hidden_size": MODEL.dim, "num_hidden_layers":
                                MODEL.n_layers, "num_attention_heads": MODEL.n_heads, "num_key_value_heads":
                                MODEL.n_kv_heads, "intermediate_size": MODEL.ffn_dim,
                                "max_position_embeddings": MODEL.max_seq_len, "rope_theta": MODEL.rope_theta,
                                "rms_norm_eps": MODEL.norm_eps}))
    return path


@pytest.mark.parametrize("extra, needle", [
    (["--resume", "{root}/nowhere"], "does not exist"),
    (["--resume", "{root}/dp2/step_2.tmp"], "not a complete checkpoint"),
    (["--resume", "{root}/dp2/step_2", "--preset", "small"], "holds a model with"),
    (["--resume", "{root}/dp2/step_2", "--steps", "2"], "not before --steps"),
    (["--resume", "{root}/dp2/step_2", "--dp", "2", "--zero", "3", "--fsdp", "full_shard"], "--zero 3"),
    (["--resume", "auto"], "--resume auto looks in --save DIR"),
    (["--save-every", "2"], "need --save DIR"),
])
def test_bad_checkpoint_input_is_one_line_before_launch(extra, needle, capsys, tmp_path):
    _report("dp2")
    partial = ROOT / "dp2" / "step_2.tmp"
    partial.mkdir(exist_ok=True)
    model = [] if "--preset" in extra else ["--config", str(_config_json(tmp_path))]
    argv = ["train", "--dp", "1", "--steps", "4", *model, *(e.format(root=ROOT) for e in extra)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def _torchrun(*argv: str, env: dict | None = None, timeout: float = 240) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _run_args(tmp_path) -> list[str]:
    """The CLI flags of the SAVED runs (MODEL, TRAIN)."""
    return ["--config", str(_config_json(tmp_path)), "--global-batch", "8", "--seq-len", "16", "--dtype", "float64",
            "--grad-clip", "0.5", "--json"]


def _last_json(out: str) -> dict:
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


def test_a_killed_rank_restarts_from_the_last_checkpoint_under_torchrun(tmp_path):
    """Rank 1 is killed after step 2 (its save done); torchrun --max-restarts 1 restarts both ranks, --resume auto
    continues from step_2, and the finished run's losses are those of the run that was never killed."""
    full = _report("dp2")
    port = _free_port()
    proc = _torchrun("--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     f"127.0.0.1:{port}", "-m", "parallelisms", "train", "--dp", "2", "--steps", "4",
                     *_run_args(tmp_path), "--save", str(tmp_path / "ckpt"), "--save-every", "1", "--resume", "auto",
                     env={"PARALLELISMS_TEST_KILL_AT": "1:2"})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    report = _last_json(out)
    assert report["first_step"] == 3 and report["losses"] == full["losses"][2:], (report["losses"], full["losses"])


def test_two_nodes_on_this_host_train_and_verify(tmp_path):
    """Two torchrun launchers (--nnodes 2, one rank each) rendezvous over c10d on 127.0.0.1 and verify passes: the
    two-node run reproduces single-process training."""
    port = _free_port()
    procs = [_torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "-m", "parallelisms",
                       "verify", "--dp", "2", "--steps", "4", *_run_args(tmp_path)) for node in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [_last_json(out) for out, _ in outs if "{" in out]
    assert len(results) == 1 and results[0]["ok"] and results[0]["world_size"] == 2, results


def _free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768 on): torchrun's store binds it later, and a port the
    kernel hands out for outgoing connections (gloo's, other tests') could be taken meanwhile."""
    while True:
        port = random.SystemRandom().randrange(20000, 32768)  # not the seeded generator: workers differ
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def _poison_step(monkeypatch, at: int) -> None:
    """The ``at``-th step's loss and gradients become NaN (in-process runs: --dp 1)."""
    from parallelisms.trainer import MicrobatchLoop

    original, calls = MicrobatchLoop.__call__, []

    def poisoned(self, inputs, targets, grad_sync):
        loss = original(self, inputs, targets, grad_sync)
        calls.append(1)
        if len(calls) == at:
            for p in grad_sync.parameters():
                p.grad.fill_(float("nan"))
            return loss * float("nan")
        return loss
    monkeypatch.setattr(MicrobatchLoop, "__call__", poisoned)


def test_a_nonfinite_step_stops_the_run_naming_step_and_rank(monkeypatch, capsys, tmp_path):
    _poison_step(monkeypatch, 2)
    assert main(["train", "--dp", "1", "--steps", "4", *_run_args(tmp_path)]) == 1
    captured = capsys.readouterr()
    report = _last_json(captured.out)
    assert report["nonfinite"] == {"step": 2, "rank": 0, "what": "loss"} and len(report["losses"]) == 2
    errors = [ln for ln in captured.err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "on rank 0 at step 2" in errors[0] and "--skip-nonfinite" in errors[0], errors


def test_skip_nonfinite_skips_the_update_and_counts_it(monkeypatch, capsys, tmp_path):
    _poison_step(monkeypatch, 2)
    assert main(["train", "--dp", "1", "--steps", "4", "--skip-nonfinite", *_run_args(tmp_path)]) == 0
    report = _last_json(capsys.readouterr().out)
    assert report["skipped_steps"] == 1 and report["nonfinite"] is None
    assert report["losses"][1] is None and all(math.isfinite(x) for i, x in enumerate(report["losses"]) if i != 1)


def test_load_full_state_reads_any_layouts_checkpoint_in_one_process():
    from parallelisms.checkpoint import load_full_state

    full = _report("pp2_zbv")
    state = load_full_state(ROOT / "pp2_zbv" / "step_4")
    assert state.keys() == full["state"].keys()
    assert all(torch.equal(state[k], t) for k, t in full["state"].items())


def test_verify_resume_prints_ok(capsys, tmp_path):
    """In one process both (the launches are covered above): saved plain, resumed with full recomputation."""
    run = f"--config {_config_json(tmp_path)} --steps 4 --global-batch 4 --seq-len 16 --dtype float64"
    assert main(["verify-resume", "--save-layout", "", "--resume-layout", "--recompute full", "--run", run,
                 "--json"]) == 0
    out = capsys.readouterr().out
    result = _last_json(out)
    assert result["ok"] and result["save_at"] == 2 and result["max_param_rel_diff"] < TOLERANCE_FLOAT64
    assert ": ok" in out.splitlines()[-2]


def test_export_writes_a_checkpoint_as_a_hugging_face_llama(tmp_path, capsys):
    """``export`` of a pipeline's (zb-v) checkpoint: transformers loads it and computes our logits."""
    transformers = pytest.importorskip("transformers")
    from parallelisms.checkpoint import load_full_state
    from parallelisms.model import build_model

    _report("pp2_zbv")
    out = tmp_path / "hf"
    assert main(["export", str(ROOT / "pp2_zbv" / "step_4"), "--out", str(out)]) == 0
    assert "exported" in capsys.readouterr().out
    ours = build_model(MODEL, 0)
    ours.load_state_dict({k: t.float() for k, t in load_full_state(ROOT / "pp2_zbv" / "step_4").items()})
    tokens = torch.randint(0, MODEL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(hf(tokens).logits, ours(tokens)) < 1e-5
    assert main(["export", str(ROOT / "pp2_zbv" / "step_2.tmp"), "--out", str(out)]) == 2


def test_resume_continues_the_schedule_the_data_and_the_metrics(tmp_path, capsys):
    """In one process: warmup + cosine, saved at step 2 of 4; the resumed run's losses are the uninterrupted run's,
    and the metrics file next to the checkpoints holds each step once."""
    run = ["train", "--dp", "1", "--steps", "4", *_run_args(tmp_path), "--warmup", "1", "--lr-schedule", "cosine"]
    assert main([*run, "--save", str(tmp_path / "a"), "--save-every", "2"]) == 0
    full = _last_json(capsys.readouterr().out)
    shutil.rmtree(tmp_path / "a" / "step_4")
    assert main([*run, "--save", str(tmp_path / "a"), "--resume", "auto"]) == 0
    resumed = _last_json(capsys.readouterr().out)
    assert resumed["first_step"] == 3 and resumed["losses"] == full["losses"][2:]
    from parallelisms.metrics import default_metrics_path, read_metrics
    assert [r["step"] for r in read_metrics(default_metrics_path(str(tmp_path / "a")))] == [1, 2, 3, 4]
