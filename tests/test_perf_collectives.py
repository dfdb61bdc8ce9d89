"""The alpha-beta model: predictions, the bucketing trade-off, and recovering alpha and beta by fitting."""

import pytest

from parallelisms.perf.collectives import AlphaBeta, fit

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)


def test_fused_bucket_saves_k_minus_one_latencies():
    model = AlphaBeta(alpha_s=50e-6, beta_s_per_byte=1e-9)
    total = 100 * 2**20
    small = model.collective_time("all_reduce", total, group_size=4, calls=100)
    fused = model.collective_time("all_reduce", total, group_size=4, calls=1)
    assert small - fused == pytest.approx(99 * 50e-6)
    assert fused == pytest.approx(50e-6 + 1e-9 * 1.5 * total)  # 2(N-1)/N of the buffer per rank
    assert model.bandwidth_bytes_per_s == pytest.approx(1e9)


def test_fit_recovers_exact_parameters_and_rejects_degenerate_input():
    truth = AlphaBeta(alpha_s=2e-5, beta_s_per_byte=3e-10)
    sizes = [2.0**k for k in range(10, 25, 2)]
    fitted, r2 = fit(sizes, [truth.time(m) for m in sizes])
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert fitted.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte, rel=1e-9)
    assert r2 == pytest.approx(1.0)
    with pytest.raises(ValueError, match="sizes must differ"):
        fit([1.0, 1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least two"):
        fit([1.0], [1.0])
