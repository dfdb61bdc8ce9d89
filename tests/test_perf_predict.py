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


def _cases():
    from parallelisms.config import ParallelConfig, TrainConfig, preset
    from parallelisms.perf.predict import CASES
    from parallelisms.support import validate_layout

    cfg, train = preset("small"), TrainConfig(steps=12, global_batch=8, seq_len=128)
    return cfg, train, {name: validate_layout(cfg, train, ParallelConfig(dims, **options))
                        for name, (dims, options) in CASES.items()}


@pytest.mark.fast
def test_each_case_measures_beside_it_the_links_its_prediction_depends_on():
    """A case's link groups are those whose doubled cost moves its prediction by 2% or more: the collectives its
    layout calls, the meeting overhead where ranks outnumber the cores, and no others."""
    import dataclasses

    from parallelisms.perf.hardware import PRESETS
    from parallelisms.perf.predict import LINK_SENSITIVITY, link_groups
    from parallelisms.perf.step import predict_step

    cpu = PRESETS["cpu"]
    cfg, train, layouts = _cases()
    groups = {name: link_groups(cfg, parallel, train, cpu) for name, parallel in layouts.items()}
    assert "all_reduce" in groups["dp2"] and {"all_gather", "reduce_scatter"} <= set(groups["tp2_sp"])
    assert "meeting" in groups["dp2_tp2_pp2"]
    assert all("meeting" not in g for name, g in groups.items() if name != "dp2_tp2_pp2")  # ranks fit the cores
    assert "send" not in groups["tp2_sp"] and "all_to_all" not in {g for gs in groups.values() for g in gs}
    base = predict_step(cfg, layouts["dp2"], train, cpu)["step_s"]  # below the threshold: left out
    slower = dataclasses.replace(cpu, meeting_overhead_us=2 * cpu.meeting_overhead_us)
    doubled = predict_step(cfg, layouts["dp2"], train, slower)
    assert doubled["step_s"] < (1 + LINK_SENSITIVITY) * base


@pytest.mark.fast
def test_a_case_without_link_groups_measures_nothing():
    """No group, no process started: the hardware comes back as it was."""
    from parallelisms.perf.hardware import PRESETS
    from parallelisms.perf.predict import _measured_links

    assert _measured_links(PRESETS["cpu"], ()) == PRESETS["cpu"]


@pytest.mark.fast
def test_a_case_error_is_the_median_of_its_rounds_paired_errors():
    """Each round is predicted with the calibration taken around it, so a slow minute (round 2: measured 30%
    slower, and its rates 25% slower) moves both sides; the verdict is the median of the rounds' own errors, not
    the error of the median-measured round against a calibration from another minute."""
    from parallelisms.perf.hardware import PRESETS
    from parallelisms.perf.predict import calibration_figures, case_verdict

    figures = calibration_figures(PRESETS["cpu"], ("all_reduce",))
    assert figures["links_measured"] == ["all_reduce"] and set(figures["collectives"]) == {"all_reduce"}
    rounds = [{"predicted_s": p, "measured_s": m, "error": p / m - 1, "start_links_error": 0.0, "calibration": figures}
              for p, m in ((0.100, 0.105), (0.125, 0.136), (0.098, 0.100))]
    verdict = case_verdict("dp2", rounds)
    assert verdict["error"] == pytest.approx(0.100 / 0.105 - 1)  # -4.8%, -8.1%, -2.0%: the median
    assert verdict["median_round"] == 0 and verdict["measured_s"] == 0.105
    assert [r["calibration"] for r in verdict["rounds"]] == [figures] * 3
    two = case_verdict("dp2", rounds[:2])  # an even count: the mean of the middle two
    assert two["error"] == pytest.approx((0.100 / 0.105 + 0.125 / 0.136) / 2 - 1)


@pytest.mark.fast
def test_a_case_takes_the_median_compute_rates_of_the_calibrations_around_it():
    """The three calibrations nearest a case give its compute rates at their median: one that misfit the memory
    line (a bandwidth a hundred times the others') is dropped; the links stay those of the last."""
    import dataclasses

    from parallelisms.perf.hardware import PRESETS
    from parallelisms.perf.predict import _around

    cpu = PRESETS["cpu"]
    runs = [dataclasses.replace(cpu, hbm_tbps=bandwidth, peak_tflops=peak, meeting_overhead_us=meeting)
            for bandwidth, peak, meeting in ((0.017, 0.090, 300), (1.7, 0.094, 200), (0.016, 0.080, 250))]
    case = _around(runs)
    assert (case.hbm_tbps, case.peak_tflops, case.meeting_overhead_us) == (0.017, 0.090, 250)
    assert _around(runs[:2]).peak_tflops == pytest.approx(0.092)  # the first case: the start's and the one after


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
