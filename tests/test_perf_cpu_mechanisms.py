"""The calibrated CPU mechanisms of the step model respond to their parameters, and GPU defaults leave them out
(no timing here: `bench predict` is the benchmark)."""

import dataclasses
import json

import pytest

from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.errors import ConfigError
from parallelisms.mesh import ParallelDims
from parallelisms.perf.compute import LayerShape, _attention_core, eager_elementwise_bytes, layer_times
from parallelisms.perf.hardware import PRESETS, load_hardware
from parallelisms.perf.step import _comm, _layer_comm, predict_step

CPU = PRESETS["cpu"]
SMALL = preset("small")
TRAIN = TrainConfig(global_batch=8, seq_len=128)


def _step(hw, dims, **options):
    return predict_step(SMALL, ParallelConfig(dims, **options), TRAIN, hw)


def test_gpu_presets_keep_the_cpu_mechanisms_off():
    for name in ("a100", "h100", "h200"):
        hw = PRESETS[name]
        assert (hw.attention_fraction, hw.optimizer_tbps, hw.optimizer_tensor_us, hw.comm_cpu_fraction) == (1, 0, 0, 0)
        assert hw.shared(64) is hw  # no cores: a device each


def test_attention_time_scales_with_the_measured_fraction():
    shape = LayerShape(SMALL, 4, 128)
    half = dataclasses.replace(CPU, attention_fraction=CPU.attention_fraction / 2)
    assert _attention_core(half, shape)[0] == pytest.approx(2 * _attention_core(CPU, shape)[0])


def test_cpu_elementwise_counts_the_eager_operators():
    shape = LayerShape(SMALL, 4, 128)
    # 20 D + 11 Q + 9 K + 2 (Q + K) (grouped heads) + 5 F elements per token, 4 bytes each
    per_token = 20 * 256 + 11 * 256 + 9 * 128 + 2 * (256 + 128) + 5 * 688
    assert eager_elementwise_bytes(shape, 4) == 512 * per_token * 4
    fused = dataclasses.replace(CPU, cores=0)
    assert layer_times(CPU, shape).forward > layer_times(fused, shape).forward


def test_optimizer_time_follows_its_rate_and_tensor_count():
    """The optimizer's time is its bytes at the measured rate plus its tensors at the measured time each:
    doubling the time per tensor adds the tensor part once, halving the rate adds the byte part once."""
    dims = ParallelDims(dp_replicate=2)

    def optimizer(hw):
        return _step(hw, dims)["time_breakdown"]["optimizer"]
    base = optimizer(CPU)
    tensors = optimizer(dataclasses.replace(CPU, optimizer_tensor_us=2 * CPU.optimizer_tensor_us)) - base
    assert 0 < tensors < base
    assert optimizer(dataclasses.replace(CPU, optimizer_tbps=CPU.optimizer_tbps / 2)) == pytest.approx(
        base + (base - tensors))


def test_overlapped_collectives_cost_their_cpu_share():
    dims = ParallelDims(dp_shard=2)
    hidden = _step(dataclasses.replace(CPU, comm_cpu_fraction=0.0), dims, zero=3)
    busy = _step(dataclasses.replace(CPU, comm_cpu_fraction=1.0), dims, zero=3)
    assert busy["step_s"] > hidden["step_s"]


def test_shared_cores_divide_rates_and_multiply_host_time():
    """Compute and memory rates divide by ranks per core; a collective's time (latency too) multiplies in its CPU
    share: through shared memory the per-call Python and system calls run on the shared core."""
    hw = CPU.shared(8)  # 8 ranks on 2 cores
    assert hw.peak_tflops == pytest.approx(CPU.peak_tflops / 4)
    assert hw.op_overhead_us == pytest.approx(CPU.op_overhead_us * 4)
    slower = 1 + CPU.comm_cpu_fraction * 3
    assert hw.collectives["send"]["gbps"] == pytest.approx(CPU.collectives["send"]["gbps"] / slower)
    assert hw.collectives["send"]["alpha_us"] == pytest.approx(CPU.collectives["send"]["alpha_us"] * slower)
    assert hw.intra_latency_us == pytest.approx(CPU.intra_latency_us * slower)
    assert CPU.shared(2) is CPU


def test_sequence_parallel_prices_the_norm_weight_all_reduces():
    """Under SP a layer's backward holds its two norm weights' gradient all-reduces over tp: making all-reduces
    free takes exactly their time off (the layer's other tp collectives are all-gathers and reduce-scatters)."""
    parallel = ParallelConfig(ParallelDims(tp=2), sequence_parallel=True)
    shape = LayerShape(SMALL, 8, 128, tp=2, sp=True)
    times = layer_times(CPU, shape)
    free = dataclasses.replace(CPU, collectives={**CPU.collectives, "all_reduce": {"alpha_us": 0.0, "gbps": 1e12}})
    name = "all_gather+reduce_scatter/tp"
    priced = _layer_comm(SMALL, parallel, CPU, shape, times)[name]
    unpriced = _layer_comm(SMALL, parallel, free, shape, times)[name]
    norms = 2 * _comm(CPU, parallel, "all_reduce", "tp", SMALL.dim * CPU.bytes_per_element)
    assert norms > 0 and priced[0] == unpriced[0]
    assert priced[1] - unpriced[1] == pytest.approx(norms, rel=1e-6)


@pytest.mark.parametrize("key,value", [("attention_fraction", 1.5), ("comm_cpu_fraction", 2), ("optimizer_tbps", -1),
                                       ("optimizer_tensor_us", "x")])
def test_hardware_file_rejects_bad_mechanism_values(tmp_path, key, value):
    path = tmp_path / "hw.json"
    raw = {k: v for k, v in CPU.to_json().items() if k != "measurements"}
    path.write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ConfigError, match=key if key != "attention_fraction" else "at most 1"):
        load_hardware(str(path))
