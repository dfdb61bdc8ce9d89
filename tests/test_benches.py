"""The benches at a tiny size: the JSON's shape only (benchmarks are not tests: no timing
asserts), and their flags' one-line errors."""

import json

import pytest

from parallelisms.cli import main

PHASES = {"forward_s", "backward_s", "optimizer_s", "exposed_comm_s"}
COMMON = {"bench", "world_size", "ours_s", "peer", "peer_s", "ratio", "ratio_rounds", "phases", "one_process_s",
          "ours_scaling_efficiency", "peer_scaling_efficiency"}


def _bench(capsys, argv) -> dict:
    assert main(["bench", *argv, "--steps", "1", "--rounds", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert COMMON <= set(result)
    assert set(result["phases"]) == {"ours", "peer", "one_process"}
    assert all(set(phases) == PHASES for phases in result["phases"].values())
    assert result["ratio"] == pytest.approx(result["ours_s"] / result["peer_s"])
    assert result["ratio_rounds"] == pytest.approx([result["ratio"]])  # one round of one step: the headline itself
    return result


def test_bench_cp_reports_ring_and_ulysses_against_one_process(capsys):
    result = _bench(capsys, ["cp", "--preset", "tiny", "--seq-lens", "64"])
    (row,) = result["lengths"]
    assert row["seq_len"] == result["seq_len"] == 64
    for style in ("ring", "ulysses"):
        assert {"step_s", "peak_bytes", "speedup", "peak_memory_vs_one_process", "scaling_efficiency"} <= set(row[style])
    assert "send" in row["ring"]["comm_per_step"] and "all_to_all" in row["ulysses"]["comm_per_step"]
    assert row["one_process"]["peak_bytes"] > 0


def test_bench_ep_reports_sharded_against_replicated_experts(capsys):
    result = _bench(capsys, ["ep", "--seq-len", "16", "--global-batch", "4"])
    assert result["ep"]["all_to_all_bytes_per_rank"] > 0 and result["replicated"]["all_to_all_bytes_per_rank"] == 0
    assert {"tokens_per_s", "peak_bytes", "exposed_comm_s"} <= set(result["ep"]) & set(result["replicated"])


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "cp", "--seq-lens", "1024,,2048"], "argument --seq-lens: must be comma-separated integers"),
    (["bench", "cp", "--seq-lens", "1"], "argument --seq-lens: must be an integer from 2"),
    (["bench", "ddp", "--seq-lens", "64"], "--seq-lens 64 applies to bench cp only, not ddp; drop --seq-lens"),
    (["bench", "ep", "--preset", "tiny"], "bench ep needs a mixture-of-experts model"),
])
def test_bad_bench_flags(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


@pytest.mark.parametrize("argv", [["tp"], ["tp", "--sp"], ["zero1"], ["pipeline", "--schedule", "1f1b"],
                                  ["pipeline-balance"]])
def test_every_bench_reports_phases_and_scaling_against_one_process(capsys, argv):
    """The keys every bench's JSON carries: the headline ratio and its rounds, the peer, ours' and the peer's
    phases, and the scaling efficiency against one process training the same global batch."""
    assert main(["bench", *argv, "--preset", "tiny", "--seq-len", "32", "--steps", "1", "--rounds", "2",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"ratio", "ratio_rounds", "peer", "phases", "single_process_s", "ours_scaling_efficiency",
            "peer_scaling_efficiency"} <= set(result)
    assert len(result["ratio_rounds"]) == 2
    assert {"forward_s", "backward_s", "exposed_comm_s"} <= set(result["phases"]["ours"]) & set(result["phases"]["peer"])
    assert result["ours_scaling_efficiency"] == pytest.approx(
        result["single_process_s"] / (result["world_size"] * result["ours_s"]))
    if argv[0] == "tp":  # what --tp-overlap --tp-overlap-chunks 2 hides, forward and backward, from the timeline
        for rank in result["overlap_per_rank"]:
            assert rank["overlap"]["forward_collectives_ms"] > 0 and rank["overlap"]["backward_collectives_ms"] > 0
            assert rank["sync"]["forward_exposed_ms"] == rank["sync"]["forward_collectives_ms"]
