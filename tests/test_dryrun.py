"""The dry run (parallelisms.dryrun): its recording transport's ledger equals a real gloo run's, rank classes
equal the every-rank run, and planted desynchronisations are caught before any process starts."""

import dataclasses
import functools

import pytest
import torch

from parallelisms.comm import CommLedger, Comms, Timeline
from parallelisms.dryrun import dry_run, dry_run_rank
from parallelisms.dryrun.fake import balance_routing
from parallelisms.launch import launch
from parallelisms.model import build_model

from _layouts import layout_with

# small layouts covering every dimension: DDP, ZeRO-1/2/3, FSDP (flat, per-parameter, reuse, hybrid), tp + sp,
# cp ring, Ulysses, all-gather and hierarchical, ep, pipeline schedules; grad accumulation, recompute and bf16 on the way
LAYOUTS = {
    "ddp-accum": (["ddp"], {"grad_accum": 2}),
    "zero1": (["zero1"], {}),
    "zero2-bf16": (["zero2", "bf16"], {}),
    "zero3": (["zero3"], {}),
    "fsdp-per-param": (["per_param"], {}),
    "fsdp-reuse": (["reuse"], {}),
    "tp-sp-recompute": (["sp", "recompute-full"], {}),
    "cp-ring": (["ring"], {}),
    "cp-ulysses": (["ulysses"], {}),
    "cp-allgather": (["allgather"], {}),
    "cp-hierarchical": (["hierarchical"], {}),
    "ep": (["ep"], {}),
    "pp-1f1b-selective": (["1f1b", "recompute-selective"], {}),
    "pp-zbv": (["zb-v"], {}),
    "pp-dualpipev": (["dualpipev"], {}),
    "pp-interleaved-tp": (["interleaved", "tp"], {}),
    "hybrid-fsdp": (["fsdp-hybrid_shard"], {}),
}


def _small(features):
    """``layout_with(features)`` on four layers with a pipeline (a layer per virtual stage of pp 2 x 2), two without
    (the per-layer collectives repeat), and 16 positions (two blocks per rank of cp 4's load-balanced ring): the
    ranks' collectives and classes as on the deeper model."""
    model, train, parallel = layout_with(features)
    layers = 4 if parallel.dims.pp > 1 else 2
    return dataclasses.replace(model, n_layers=layers), train.replace(seq_len=16), parallel


def _layout(name):
    features, train_options = LAYOUTS[name]
    model, train, parallel = _small(features)
    return model, train.replace(**train_options), parallel


def _real_records(info, world: int) -> dict:
    """name -> this rank's ledger records of the setup and one real training step, for every layout of ``world``
    ranks (gloo, real data; MoE routing balanced as in the dry run)."""
    from parallelisms.api import batches
    from parallelisms.training import parallelize

    out = {}
    for name in LAYOUTS:
        model_cfg, train, parallel = _layout(name)
        if parallel.dims.world_size != world:
            continue
        torch.manual_seed(train.seed)
        comms = Comms(parallel.dims.build_meshes("cpu"), CommLedger(), Timeline(info.rank, enabled=False))
        model = build_model(model_cfg, train.seed, "cpu", train.torch_dtype)
        balance_routing(model)
        trainer = parallelize(model, parallel, train, comms)
        inputs, targets = next(batches(train, parallel, steps=1, device="cpu"))
        trainer.train_step(inputs, targets)
        out[name] = list(comms.ledger.records)
        trainer.close()
    return out


@functools.lru_cache(maxsize=None)
def real_run(world: int) -> list[dict]:
    return launch(_real_records, world, world, threads=1)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_recording_ledger_equals_a_real_run(name):
    model, train, parallel = _layout(name)
    world = parallel.dims.world_size
    real = real_run(world)
    for rank in range(world):
        dry = dry_run_rank(model, train, parallel, rank, memory=False)
        assert dry.records == real[rank][name], (name, rank)
        assert dry.records and len(dry.events) == len(dry.records)


@pytest.mark.parametrize("features", [["sp", "zero1"], ["interleaved", "ddp"], ["ring", "ep", "ddp"], ["dualpipev", "tp"]])
def test_rank_classes_equal_the_every_rank_run(features):
    model, train, parallel = _small(features)
    every = dry_run(model, train, parallel, every_rank=True)
    by_class = dry_run(model, train, parallel)
    assert every["precheck"] == by_class["precheck"] and every["precheck"]["ok"], every["precheck"]
    for members in every["classes"].values():
        first = every["runs"][members[0]]
        for rank in members[1:]:
            run = every["runs"][rank]
            assert [e.signature() + (e.dim, e.phase) for e in run.events] == \
                   [e.signature() + (e.dim, e.phase) for e in first.events]
            assert run.memory == first.memory, (rank, members[0])
    assert len(by_class["runs"]) == len(every["classes"]) < parallel.dims.world_size


def _planted(rank: int, method: str, plant):
    """A dry_run_rank whose ``rank`` has ``RecordingComm.method`` replaced by ``plant(original)``."""
    from parallelisms.comm.recording import RecordingComm

    def run_rank(model, train, parallel, r, memory=True):
        if r != rank:
            return dry_run_rank(model, train, parallel, r, memory)
        original = getattr(RecordingComm, method)
        setattr(RecordingComm, method, plant(original))
        try:
            return dry_run_rank(model, train, parallel, r, memory)
        finally:
            setattr(RecordingComm, method, original)
    return run_rank


def _first_violation(kind: str, rank: int, method: str, plant, train_changes=None) -> str:
    """The precheck's first violation of the small layout ``kind`` with ``plant`` wrapping ``method`` on ``rank``
    (every rank run); fails if the precheck passes."""
    model, train, parallel = _small([kind])
    result = dry_run(model, train.replace(**(train_changes or {})), parallel, memory=False, every_rank=True,
                     run_rank=_planted(rank, method, plant))
    assert not result["precheck"]["ok"]
    return result["precheck"]["violations"][0]


@pytest.mark.parametrize("rank", [0, 13, 22, 31])
def test_the_mesh_plan_is_the_groups_build_meshes_makes(rank):
    """:meth:`ParallelDims.group` (the precheck's groups, the step model's strides) against the ``DeviceMesh`` the
    runtime builds on the fake process group: every dimension's group of ``rank`` in a 5-D layout with expert
    parallelism, and hierarchical context parallelism's split of cp (``parallel/cp_hierarchical.py``)."""
    import torch.distributed as dist

    from parallelisms.dryrun.fake import fake_rank
    from parallelisms.mesh import ParallelDims
    from parallelisms.parallel.cp_hierarchical import _split_cp

    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=4, tp=2, pp=1, ep=4)
    with fake_rank(rank, dims.world_size):
        comms = Comms(dims.build_meshes("cpu"), CommLedger(), Timeline(rank, enabled=False))
        _split_cp(comms, 2)
        for name, mesh in comms.meshes.items():  # the world: every rank, its 5-D mesh in rank order
            ranks = mesh.mesh.flatten().tolist() if mesh.ndim > 1 else dist.get_process_group_ranks(mesh.get_group())
            assert tuple(ranks) == dims.group(name, rank, 2), name
    assert len(comms.meshes) == 14  # the five axes, dp, dp_cp, dp_shard_cp, ep, ep_bwd, ep_replicate, cp's two, world


def test_a_rank_that_skips_a_bucket_is_caught():
    def skip_second(original):
        calls = []

        def all_reduce(self, tensor, *args, **kwargs):
            calls.append(1)
            if self.ledger.phase == "backward" and len(calls) == 2:
                return tensor if not kwargs.get("async_op") else original(self, tensor[:0], *args, **kwargs)
            return original(self, tensor, *args, **kwargs)
        return all_reduce

    message = _first_violation("ddp", 1, "all_reduce", skip_second, {"bucket_mb": 0.01})  # several buckets
    assert "group 'dp_cp' [0, 1]" in message and "collective #" in message and "rank 1" in message, message


def test_a_stage_that_sends_one_microbatch_too_many_is_caught():
    def one_more(original):
        def send_recv(self, sends=(), recvs=()):
            pending = original(self, sends, recvs)
            if sends and self.name == "pp" and not hasattr(self, "_planted"):
                self._planted = True
                original(self, sends[:1], ())
            return pending
        return send_recv

    message = _first_violation("1f1b", 0, "send_recv", one_more)
    assert "from rank 0 to rank 1" in message and "receives nothing" in message, message


def test_an_expert_all_to_all_with_a_wrong_split_is_caught():
    def wrong_split(original):
        def all_to_all(self, tensor, output_splits=None, input_splits=None, async_op=False):
            if input_splits is not None and input_splits[0] > 0:
                input_splits = [input_splits[0] - 1, input_splits[1] + 1, *input_splits[2:]]
            return original(self, tensor, output_splits, input_splits, async_op)
        return all_to_all

    message = _first_violation("ep", 1, "all_to_all", wrong_split)
    assert "all_to_all" in message and "expects" in message, message


def test_a_correct_layout_passes_with_its_counts():
    model, train, parallel = _small(["zb-v", "tp"])
    result = dry_run(model, train, parallel, memory=False)
    check = result["precheck"]
    assert check["ok"] and check["groups"] >= 2 and check["collectives"] > 0 and check["messages"] > 0, check
    assert dataclasses.asdict(parallel.dims)["pp"] == 2


def test_float64_and_tied_embeddings_run_dry():
    """A float64 run (its precheck too) with the head tied to the embedding: the fake parameters are cast as
    ``build_model`` casts them, the tied weight once, so the parameters weigh twice the fp32 run's."""
    model, train, parallel = _small(["tp", "sp"])
    model = dataclasses.replace(model, tie_embeddings=True)
    params = {}
    for dtype in ("float32", "float64"):
        result = dry_run(model, train.replace(dtype=dtype), parallel)
        assert result["precheck"]["ok"], result["precheck"]
        params[dtype] = result["runs"][0].memory["split"]["params"]
    assert params["float64"] == 2 * params["float32"] > 0, params


def _main(argv, capsys):
    from parallelisms.cli import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dryrun_command_json_and_summary(capsys):
    import json

    code, out, _ = _main(["dryrun", "--dp", "2", "--pp", "2", "--layers", "4", "--gpus", "4", "--json"], capsys)
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and result["precheck"]["ok"] and result["world_size"] == 4
    assert [c["ranks"] for c in result["rank_classes"]] == [2, 2]
    assert all(m["peak_bytes"] > m["persistent_bytes"] > 0 and m["fits"] for m in result["memory_per_rank"])
    assert {(c["group"], c["kind"]) for c in result["collectives"]} >= {("dp_cp", "all_reduce"), ("pp", "send")}
    assert "collective-order proof" in out and "rank class" in out


def test_dryrun_bad_input_is_one_line(capsys, tmp_path):
    code, _, err = _main(["dryrun", "--dp", "2", "--tp", "2", "--gpus", "8"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "4 ranks, but --gpus is 8" in err, err
    code, _, err = _main(["dryrun", "--gpus", "0"], capsys)  # a count of GPUs, before any config is built
    assert code == 2 and err.strip() == ("error: argument --gpus: must be an integer from 1 to 1,048,576, got 0 "
                                         "(see parallelisms dryrun --help)"), err
    from parallelisms.perf.hardware import PRESETS

    tiny = {**dataclasses.asdict(PRESETS["h100"]), "name": "tiny", "hbm_gb": 0.001}
    (tmp_path / "tiny.json").write_text(__import__("json").dumps(tiny))
    code, _, err = _main(["dryrun", "--dp", "2", "--hardware", str(tmp_path / "tiny.json")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not fit: rank 0" in err and "GiB over" in err, err


def test_dry_run_peak_is_within_ten_percent_of_the_measured_heap_peak():
    """2 ranks of DDP: the dry run's peak against the real run's peak heap bytes over the same setup and two
    steps (dryrun/measured.py: after a warm-up run, above the heap before the model is built)."""
    from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
    from parallelisms.dryrun.measured import measured_peaks
    from parallelisms.mesh import ParallelDims

    model = ModelConfig(vocab_size=2048, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=512, max_seq_len=256)
    train, parallel = TrainConfig(global_batch=8, seq_len=256), ParallelConfig(ParallelDims(dp_replicate=2))
    measured = measured_peaks(model, train, parallel)
    dry = [dry_run_rank(model, train, parallel, r).memory["peak_bytes"] for r in range(2)]
    for d, m in zip(dry, measured):
        assert abs(d / m - 1) < 0.10, (dry, measured)


def test_split_backward_leaves_no_stale_head_weight():
    """A split-backward schedule swaps each stage's linear layers for ones whose weight gradient can wait; the full
    model the caller keeps shares the swapped head, so the engines own every weight the rank holds (the full model
    used to keep the old head's fp32 weight alive beside them: vocabulary x hidden on the head's rank, tp 1)."""
    from parallelisms.api import configure
    from parallelisms.comm.recording import RecordingComms, RecordingLedger
    from parallelisms.dryrun.fake import fake_rank
    from parallelisms.dryrun.run import build_fake_model
    from parallelisms.train_setup import parallelize

    cfg = configure("--hidden 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 512 --layers 4 --seq-len 32 --pp 2 "
                    "--schedule zb-v --mixed-precision bf16 --global-batch 4 --microbatches 4".split())
    with fake_rank(0, 2):
        comms = RecordingComms(cfg.layout.dims.build_meshes("cpu"), RecordingLedger(), Timeline(0, enabled=False))
        model = build_fake_model(cfg.model, cfg.train)
        trainer = parallelize(model, cfg.layout, cfg.train, comms)
        assert model.output is trainer.forward_backward.stages[3].output  # rank 0 holds stages 0 and 3
        assert [name for name, _ in model.named_parameters()] == []


def _multi_rank_features() -> list[str]:
    from _layouts import FEATURES

    return sorted(name for name in FEATURES if layout_with([name])[2].dims.world_size > 1)


@pytest.mark.parametrize("name", _multi_rank_features())
def test_every_feature_row_passes_the_precheck_before_launch(name, capsys):
    """``train``/``verify``'s precheck follows the layout of every support-table feature row: the proof holds and
    the dry run does not fail into the warning that skips it."""
    from parallelisms.dryrun.cli import precheck_before_launch

    precheck_before_launch(*_small([name]))
    assert "precheck skipped" not in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_measured_pipeline_balance_is_followed(schedule, capsys):
    """``--pp-balance measured``: every rank takes rank 0's cut over the setup's all-gather (recorded on every
    rank); the dry run cuts by the parts' modelled FLOPs (a large head: the last stage holds fewer layers), builds
    only the rank's blocks of that cut, and the precheck runs without the warning."""
    from parallelisms.dryrun.cli import precheck_before_launch
    from parallelisms.dryrun.run import layers_on, modelled_costs

    model, train, parallel = layout_with([schedule])
    model = dataclasses.replace(model, vocab_size=4096)
    parallel = parallel.replace(pp_balance="measured")
    result = dry_run(model, train, parallel, memory=False)
    assert result["precheck"]["ok"], result["precheck"]
    for run in result["runs"].values():
        assert [(e.kind, e.dim, e.phase) for e in run.events if e.kind == "all_gather_object"] == [
            ("all_gather_object", "world", "setup")]
    held = {r: layers_on(parallel, model, r, modelled_costs(model, train, parallel)) for r in (0, 1)}
    if schedule == "1f1b":
        assert len(held[0]) > len(held[1]) and sorted(held[0] + held[1]) == list(range(model.n_layers)), held
    precheck_before_launch(model, train, parallel)
    assert "precheck skipped" not in capsys.readouterr().err
