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
