"""``train --predict``: the step model beside the run just done; the bytes per collective kind and the model
states it predicts equal the measured ones (the timing comparison is a benchmark, `bench predict`, not a test)."""

import json

import pytest

from parallelisms.cli import main


def test_train_predict_sets_the_model_beside_the_run(capsys):
    argv = ["train", "--preset", "tiny", "--dp", "2", "--steps", "3", "--global-batch", "8", "--seq-len", "32",
            "--predict", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("predicted/measured: step") for line in out)
    prediction = json.loads(out[-1])["prediction"]
    assert prediction["predicted_s"] > 0 and prediction["measured_s"] > 0
    assert set(prediction["phases"]) == {"forward", "backward", "optimizer"}
    for kind, row in prediction["bytes"].items():
        assert row["predicted"] == pytest.approx(row["measured"], rel=1e-12), kind
    memory = prediction["memory"]
    # measured also holds AdamW's step counters (one 4-byte scalar per parameter tensor)
    assert memory["predicted_model_states"] == pytest.approx(memory["measured_model_states"], rel=1e-4)


@pytest.mark.fast
def test_bench_predict_takes_the_collectives_median_over_the_run():
    """Collective alphas and the meeting overhead scatter from one launch to the next: each case gets their
    median over the run's calibrations, while its compute rates stay the ones measured around it."""
    import dataclasses

    from parallelisms.perf.hardware import PRESETS
    from parallelisms.perf.predict import _links_of, _pooled_links

    cpu = PRESETS["cpu"]
    runs = [dataclasses.replace(cpu, intra_latency_us=alpha, meeting_overhead_us=meeting, peak_tflops=peak,
                                collectives={"send": {"alpha_us": alpha, "gbps": gbps}})
            for alpha, meeting, peak, gbps in ((300, 500, 0.07, 3.0), (900, 270, 0.08, 1.0), (500, 410, 0.09, 2.0))]
    pooled = _pooled_links(runs)
    assert (pooled.intra_latency_us, pooled.meeting_overhead_us) == (500, 410)
    assert pooled.collectives == {"send": {"alpha_us": 500, "gbps": 2.0}}
    case = _links_of(pooled, runs[1])
    assert case.peak_tflops == 0.08 and case.collectives["send"]["alpha_us"] == 500


@pytest.mark.fast
def test_measured_phases_are_per_step_medians_after_the_first():
    """A phase's spans are summed step by step (two microbatches a step here) and the median taken over the
    steps the step time's is (all but the first): warm-up steps (the first three here) do not lift it as a
    mean would."""
    from types import SimpleNamespace

    from parallelisms.perf.predict import _measured_phases

    forward_ms = [50, 50, 40, 40, 30, 20, 18, 18, 18, 19, 18, 17, 18, 18]  # 7 steps of 2 microbatches
    spans = [SimpleNamespace(name="forward", start=0, end=ms * 10**6) for ms in forward_ms]
    spans += [SimpleNamespace(name="optimizer", start=0, end=(9 if step else 30) * 10**6) for step in range(7)]
    phases = _measured_phases({"steps": 7}, spans)
    assert phases["forward"] == pytest.approx(0.0365)  # per step 100, 80, 50, 36, 37, 35, 36 ms: (36 + 37) / 2
    assert phases["optimizer"] == pytest.approx(0.009)
    assert "backward" not in phases
