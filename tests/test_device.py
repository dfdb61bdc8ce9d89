"""The device and backend a run picks (``--device``), judged per machine, with what torch reports patched:
no CUDA, one GPU for two local ranks, two 8-GPU machines under torchrun; and the choice in the output."""

import json

import pytest
import torch

from parallelisms.cli import main
from parallelisms.device import choose
from parallelisms.errors import ConfigError


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch reports ``n`` CUDA devices (0: CUDA absent)."""
    def report(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return report


@pytest.fixture
def torchrun(monkeypatch):
    """``torchrun(world, local)``: the environment torchrun gives rank 0 of ``world`` ranks, ``local`` per node."""
    def env(world: int, local: int):
        for name, value in (("TORCHELASTIC_RUN_ID", "test"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                            ("WORLD_SIZE", str(world)), ("LOCAL_WORLD_SIZE", str(local))):
            monkeypatch.setenv(name, value)
    return env


def test_no_cuda_is_cpu_over_gloo(gpus):
    gpus(0)
    assert (choose("auto", 2).device, choose("auto", 2).backend) == ("cpu", "gloo")
    assert choose("cpu", 1).backend == "none"  # one process: no process group
    with pytest.raises(ConfigError, match="--device cuda needs a GPU for each of the 1 ranks on this machine, found 0"):
        choose("cuda", 1)


def test_one_gpu_two_local_ranks(gpus):
    gpus(1)
    assert choose("auto", 1).describe() == "cuda, one process"
    assert choose("auto", 2).describe() == "cpu (gloo)"  # two ranks would share the GPU
    with pytest.raises(ConfigError, match="each of the 2 ranks on this machine, found 1; use --device cpu"):
        choose("cuda", 2)


def test_two_nodes_of_eight_gpus_under_torchrun(gpus, torchrun):
    gpus(8)
    assert choose("auto", 16).device == "cpu"  # a local launch puts all 16 ranks on this machine
    torchrun(16, 8)  # judged per machine: 8 local ranks on 8 GPUs, although the world is 16
    assert choose("auto", 16).describe() == "cuda (nccl)"
    assert choose("cuda", 16).backend == "nccl"
    torchrun(16, 16)
    assert choose("auto", 16).device == "cpu"


def test_unknown_device_and_unmet_cuda_are_one_line_before_launch(capsys, gpus):
    gpus(0)
    for argv, fragment in ((["train", "--device", "tpu"], "unknown --device 'tpu'; choose auto, cpu, cuda"),
                           (["verify", "--device", "cuda", "--dp", "1"], "--device cuda needs a GPU for each")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err


def test_device_and_backend_in_summary_and_json(capsys, gpus):
    gpus(0)
    assert main(["train", "--dp", "1", "--steps", "2", "--global-batch", "2", "--seq-len", "16", "--json"]) == 0
    captured = capsys.readouterr()
    assert "step/s" not in captured.err and "s/step" not in captured.err  # no progress bar when stderr is no terminal
    out = captured.out.splitlines()
    assert out[0] == "train single: 1 rank on cpu, one process"  # the layout that will run, before it runs
    assert any(line.startswith("ran:   single on 1 rank, cpu, one process; model tiny") for line in out), out
    report = json.loads(out[-1])
    assert (report["device"], report["backend"]) == ("cpu", "none")
