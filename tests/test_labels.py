"""Output people read: layout labels name every option that changes the computation; ``--help`` shows
defaults and help for every option; train and verify share defaults; ``--version``; small models in estimates."""

import json

import pytest

from parallelisms.cli import build_configs, build_parser, main
from parallelisms.config import ParallelConfig
from parallelisms.mesh import ParallelDims

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)


@pytest.mark.parametrize("layout, label", [
    (ParallelConfig(), "single"),
    (ParallelConfig(ParallelDims(dp_replicate=2, tp=2), sequence_parallel=True), "dp2 x tp2 +sp"),
    (ParallelConfig(ParallelDims(dp_shard=4), zero=3), "dpshard4 zero3"),
    (ParallelConfig(ParallelDims(cp=2), cp_attention="ulysses"), "cp2 ulysses"),
    (ParallelConfig(ParallelDims(cp=2)), "cp2 ring"),
    (ParallelConfig(ParallelDims(pp=2), schedule="zb-v"), "pp2 zb-v"),
    (ParallelConfig(ParallelDims(pp=2), schedule="interleaved", chunks=2, microbatches=8),
     "pp2 interleaved 8 microbatches 2 chunks"),
    (ParallelConfig(ParallelDims(dp_replicate=2, dp_shard=2), fsdp="hybrid_shard"), "dp2 x dpshard2 fsdp hybrid_shard"),
    (ParallelConfig(ParallelDims(dp_shard=2), fsdp="full_shard", fsdp_style="per_param", mixed_precision="bf16"),
     "dpshard2 fsdp full_shard per_param bf16"),
    (ParallelConfig(ParallelDims(dp_replicate=2, tp=2), tp_overlap=True, recompute="full"),
     "dp2 x tp2 +tp-overlap recompute full"),
    (ParallelConfig(ParallelDims(dp_shard=4, ep=4)), "dpshard4 x ep4"),
])
def test_label_names_every_option(layout, label):
    assert layout.label() == label


def _estimate(capsys, *argv) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def test_estimate_labels_and_small_models(capsys):
    assert _estimate(capsys, "--dp", "2", "--tp", "2", "--sp")["layout"] == "dp2 x tp2 +sp"
    assert main(["estimate", "--preset", "tiny", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "106.82 K parameters" in out and "0.00 B" not in out and "0.00 GiB" not in out, out
    assert _estimate(capsys, "--pp", "2", "--schedule", "pipedream", "--mixed-precision", "bf16")["layout"] == \
        "pp2 pipedream bf16"
    # an estimate only computes: it does not consult the runtime's support table
    assert _estimate(capsys, "--pp", "2", "--dp", "2", "--schedule", "pipedream", "--zero", "1")["layout"] == \
        "pp2 x dpshard2 zero1 pipedream"
    assert main(["train", "--pp", "2", "--dp", "2", "--schedule", "pipedream", "--zero", "1"]) == 2


def test_train_and_verify_share_defaults():
    parser = build_parser()
    for argv, dims in ((["--pp", "2"], dict(pp=2, dp=1)), ([], dict(pp=1, dp=2)), (["--tp", "2"], dict(tp=2, dp=1)),
                       (["--zero", "3"], dict(dp_shard=2)), (["--dp", "4"], dict(dp=4))):
        layouts = [build_configs(parser.parse_args([verb, *argv]))[2] for verb in ("train", "verify")]
        assert layouts[0] == layouts[1], argv
        assert all(getattr(layouts[0].dims, k) == v for k, v in dims.items()), (argv, layouts[0].dims)
    train, verify = (vars(parser.parse_args([verb])) for verb in ("train", "verify"))
    shared = set(train) & set(verify) - {"steps", "func", "command", "dtype"}  # verify's unset dtype: fp32, then float64
    assert train["dtype"] == "float32" and verify["dtype"] is None
    assert {k: train[k] for k in shared} == {k: verify[k] for k in shared}


def test_help_shows_defaults_and_every_option_has_help():
    parser = build_parser()
    verbs = parser._subparsers._group_actions[0].choices
    assert {"train", "verify", "estimate", "simulate", "bench", "plot-trace"} <= set(verbs)
    for name, sub in verbs.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
        text = sub.format_help()
        if name in ("train", "verify"):
            assert "(default: tiny)" in text and "(default: auto)" in text and "(default: 16)" in text, text


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == "parallelisms 0.1.0"


def test_plot_trace_draws_a_train_trace(capsys, tmp_path):
    spans = []
    for rank in (0, 1):
        t = 0.0
        for step in range(3):
            for name, tid, dur in (("forward", 0, 5.0), ("backward", 0, 9.0), ("all_reduce 64xfloat32", 1, 4.0),
                                   ("optimizer", 0, 2.0)):
                spans.append({"name": name, "cat": "comm" if tid else "compute", "ph": "X", "pid": rank, "tid": tid,
                              "ts": t, "dur": dur})
                t += dur if tid == 0 else 0.0
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": spans}))
    assert main(["plot-trace", str(trace), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 1000 and "timeline written to" in capsys.readouterr().out
    assert main(["plot-trace", str(tmp_path / "missing.json"), "--out", str(tmp_path / "t.png")]) == 2
    assert "is not a trace written by train --trace" in capsys.readouterr().err
