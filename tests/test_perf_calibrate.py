"""``parallelisms calibrate`` writes a hardware file that estimate, plan and train --predict read back; the
fitted alpha-beta lines describe their own measurements (R^2) and the GEMM rows give a positive peak."""

import json

from parallelisms.cli import main
from parallelisms.perf.hardware import load_hardware


def test_calibrate_writes_a_loadable_hardware_file(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--out", str(out), "--quick"]) == 0
    hw = load_hardware(str(out))
    assert hw.peak_tflops > 0 and hw.hbm_tbps > 0 and hw.cores >= 1
    assert set(hw.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"}
    assert 0 < hw.attention_fraction <= 1 and hw.attention_backward > 0 and 0 <= hw.comm_cpu_fraction <= 1
    assert hw.optimizer_tbps > 0 and hw.optimizer_tensor_us >= 0 and hw.op_overhead_us >= 0
    assert hw.meeting_overhead_us >= 0 and hw.overlap_overhead_us >= 0
    raw = json.loads(out.read_text())
    assert all(len(v["rows"]) >= 5 for v in raw["measurements"]["collectives"].values())
    capsys.readouterr()
    assert main(["estimate", "--preset", "tiny", "--dp", "2", "--hardware", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step_s"] > 0


def test_the_meeting_calibration_counts_one_steps_collectives():
    """``meeting_overhead_us`` divides the CPU growth by the blocking collectives of one tp 2 SP step of
    ``small``, as the ledger counts them: per block 4 forward and 8 backward (the re-gathers and the norms'
    all-reduces), and the ends' 8 (the embedding's 2, the head's 6), the count step.py's ``_meetings`` charges."""
    from parallelisms.launch import launch
    from parallelisms.perf.calibrate_comm import _meetings_rank

    for cpu, meetings in launch(_meetings_rank, 2, 1, 1, backend="gloo", threads=1):
        assert cpu > 0 and meetings == 4 * (4 + 8) + 8
