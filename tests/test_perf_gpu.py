"""The step model's GPU mechanisms against closed forms: the sustained clock, FP8 GEMMs and their casts, the
host-dispatch floor of small layers, tensor parallelism's dispatched calls on a GPU, and the planner's reason."""

import dataclasses

import pytest

from parallelisms.cli import main
from parallelisms.config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from parallelisms.errors import ConfigError
from parallelisms.mesh import ParallelDims
from parallelisms.perf.compute import (BLOCK_OPS, GPU_TP_BLOCK_OPS, LayerShape, _linears, block_ops, fp8_cast_bytes,
                                       gemm_time, head_gemms, layer_times)
from parallelisms.perf.cpu import TP_BLOCK_OPS
from parallelisms.perf.estimate import bottleneck, estimate
from parallelisms.perf.hardware import PRESETS as HARDWARE

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)

H100, A100 = HARDWARE["h100"], HARDWARE["a100"]
BIG = (16384, 16384, 16384)  # compute-bound, whole waves, long reduction


def test_sustained_clock_scales_gemms_not_mfu():
    at_peak = dataclasses.replace(H100, sustained_tflops=0)
    ratio = gemm_time(H100, *BIG) / gemm_time(at_peak, *BIG)
    assert ratio == pytest.approx(1980 / 1755)
    cfg, parallel, train = PRESETS["llama3-8b"], ParallelConfig(ParallelDims(dp_replicate=8), mixed_precision="bf16"), \
        TrainConfig(global_batch=8, seq_len=2048)
    slow, fast = estimate(cfg, parallel, train, H100), estimate(cfg, parallel, train, at_peak)
    assert slow["step_s"] > fast["step_s"]
    assert slow["mfu"] * slow["step_s"] == pytest.approx(fast["mfu"] * fast["step_s"])  # same datasheet peak


def test_fp8_doubles_compute_bound_gemms_and_adds_its_casts():
    assert gemm_time(H100.fp8(), *BIG) == pytest.approx(gemm_time(H100, *BIG) * 989 / 1979)
    shape = LayerShape(PRESETS["llama3-8b"], 2, 4096, tp=2)
    forward, backward = fp8_cast_bytes(shape)
    linears = _linears(shape)
    assert forward == sum(3 * m * k * b for m, n, k, b in linears)
    assert backward == sum(3 * (2 * m * n + m * k) * b for m, n, k, b in linears)
    bf16, fp8 = layer_times(H100, shape), layer_times(H100, dataclasses.replace(shape, fp8=True))
    assert fp8.weight_grad < 0.6 * bf16.weight_grad and fp8.forward < bf16.forward
    with pytest.raises(ConfigError, match="no FP8 tensor cores"):
        A100.fp8()


def test_fp8_estimate_is_marked_not_runnable(capsys):
    argv = ["estimate", "--preset", "llama3-8b", "--dp", "8", "--global-batch", "8", "--seq-len", "2048",
            "--mixed-precision", "bf16", "--hardware", "h100"]
    assert main([*argv, "--fp8"]) == 0
    assert "FP8: predicted only" in capsys.readouterr().out
    assert main([*argv[:-2], "--hardware", "a100", "--fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no FP8 tensor cores" in err


def test_small_layers_are_bound_by_dispatch_on_a_gpu():
    """Eager PyTorch issues each operator from the host; a layer whose kernels are shorter than that is the
    host's: its forward is the operators' count times the dispatch time, whatever its size."""
    tiny = ModelConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=1024, mlp="gelu")
    times = layer_times(A100, LayerShape(tiny, 1, 128))
    assert times.forward == pytest.approx(BLOCK_OPS["gelu"][0] * A100.op_overhead_us * 1e-6)


def test_gpu_tensor_parallelism_dispatches_only_its_collectives():
    for sp in (False, True):
        key = "sp" if sp else "tp"
        cpu, gpu = block_ops("swiglu", 2, sp), block_ops("swiglu", 2, sp, device=True)
        assert gpu == tuple(b + e for b, e in zip(BLOCK_OPS["swiglu"], GPU_TP_BLOCK_OPS[key]))
        assert cpu == tuple(b + e for b, e in zip(BLOCK_OPS["swiglu"], TP_BLOCK_OPS[key]))
    assert GPU_TP_BLOCK_OPS["tp"] == (2, 2)  # Megatron's g forward and f backward, per sublayer


def test_bottleneck_names_the_bound_and_the_largest_cost():
    result = {"step_s": 10.0, "time_breakdown": {"compute": 7.0, "bubble": 2.0, "optimizer": 0.2,
                                                 "exposed_comm": {"all_reduce/dp": 0.8}}}
    assert bottleneck(result) == "compute 70%; pipeline bubble 20%"
    result["time_breakdown"]["bubble"] = 0.1
    assert bottleneck(result) == "compute 70%; exposed all_reduce/dp 8%"


def test_overlapped_param_gather_hides_behind_the_first_forward():
    """ZeRO-1/2's gather of the updated parameters: exposed whole after the optimizer, or under the next step's
    first forward bucket by bucket (--overlap-param-gather): the first bucket and what outlasts the forward."""
    from parallelisms.perf.step import Layout, _data_parallel_exposed

    cfg, lay = PRESETS["small"], Layout(1, 1, 2, 2)
    traffic = [("all_gather/dp", "update", 0.4, 4)]
    assert _data_parallel_exposed(traffic, cfg, lay, 1.0, 2.0, A100)["all_gather/dp"] == 0.4
    overlapped = [("all_gather/dp", "overlapped_update", 0.4, 4)]
    assert _data_parallel_exposed(overlapped, cfg, lay, 1.0, 2.0, A100)["all_gather/dp"] == pytest.approx(0.1)
    assert _data_parallel_exposed(overlapped, cfg, lay, 0.25, 2.0, A100)["all_gather/dp"] == pytest.approx(0.25)
    parallel = ParallelConfig(ParallelDims(dp_shard=8), zero=1, mixed_precision="bf16")
    train = TrainConfig(global_batch=8, seq_len=2048)
    exposed, hidden = (estimate(PRESETS["llama3-8b"], parallel.replace(overlap_param_gather=o), train, H100)
                       for o in (False, True))
    assert hidden["step_s"] < exposed["step_s"]
    assert hidden["time_breakdown"]["exposed_comm"]["all_gather/dp"] < \
        exposed["time_breakdown"]["exposed_comm"]["all_gather/dp"]


def test_forward_tp_overlap_is_a_two_stage_pipeline_over_row_blocks():
    """--tp-overlap-chunks C: block i's all-reduce under block i+1's GEMM; exposed: the pipeline's span
    g + c + (C-1) max(g, c) less the unchunked GEMM (so the chunking's smaller GEMMs are charged too)."""
    from parallelisms.perf.overlap import chunked_overlap

    gemm = (8192, 4096, 4096, 1, 0)
    whole, g = gemm_time(A100, 8192, 4096, 4096), gemm_time(A100, 2048, 4096, 4096)
    for c in (g / 10, g, 10 * g):
        assert chunked_overlap(A100, gemm, 4 * c, c, 4) == pytest.approx(g + c + 3 * max(g, c) - whole)
    assert chunked_overlap(A100, gemm, 1e-3, 1e-3, 1) == 1e-3  # one chunk: the all-reduce, exposed
    assert chunked_overlap(A100, gemm, 4 * g / 10, g / 10, 4) < 4 * g / 10  # compute-bound: mostly hidden
    cfg, train = PRESETS["llama3-8b"], TrainConfig(global_batch=16, seq_len=4096)
    steps = [estimate(cfg, ParallelConfig(ParallelDims(dp_replicate=2, tp=4), mixed_precision="bf16", tp_overlap=True,
                                          tp_overlap_chunks=c), train, A100)["time_breakdown"]["exposed_comm"]
             ["all_reduce/tp"] for c in (0, 4)]
    assert steps[1] < steps[0]


SP_SHAPE = LayerShape(PRESETS["llama3-8b"], 1, 8192, tp=4, sp=True)
SP_LAYOUT = ParallelConfig(ParallelDims(tp=4), sequence_parallel=True, mixed_precision="bf16")


def _sp_collectives(parallel, calls: int = 1):
    """Seconds of one tp all-gather, reduce-scatter (1/calls of the activation each) and norm-weight all-reduce."""
    from parallelisms.perf.network import comm_time

    activation, cfg = SP_SHAPE.tokens * SP_SHAPE.cfg.dim * A100.bytes_per_element, SP_SHAPE.cfg
    return (comm_time(A100, parallel, "all_gather", "tp", activation / calls),
            comm_time(A100, parallel, "reduce_scatter", "tp", activation / calls),
            comm_time(A100, parallel, "all_reduce", "tp", cfg.dim * A100.bytes_per_element))


def test_forward_tp_overlap_under_sp_pipelines_the_gathers_and_scatters():
    """--sp --tp-overlap-chunks C: each column region's GEMM consumes its sequence all-gather piece by piece
    (piece i+1 gathered under piece i's GEMM) and each row-parallel GEMM's output is reduce-scattered piece by
    piece under the next piece's GEMM: per (GEMM G, collective) pair exposed g + c + (C-1) max(g, c) - G, with
    g = G's GEMM on m/C rows and c the collective of 1/C of the activation. The backward is the unchunked one."""
    from parallelisms.perf.overlap import head_comm, tensor_parallel_comm

    c, times = 4, layer_times(A100, SP_SHAPE)
    overlap = dataclasses.replace(SP_LAYOUT, tp_overlap=True)
    chunked = dataclasses.replace(overlap, tp_overlap_chunks=c)
    gather, scatter, _ = _sp_collectives(chunked, c)
    expected = 0.0
    for (m, n, k, b), piece in zip(_linears(SP_SHAPE), (gather, scatter, gather, scatter)):  # QKV, out, MLP in, out
        g, whole = gemm_time(A100, m / c, n, k, b, n * k), gemm_time(A100, m, n, k, b, n * k)
        expected += max(0.0, g + piece + (c - 1) * max(g, piece) - whole)
    assert A100.comm_cpu_fraction == 0
    forward, backward = tensor_parallel_comm(SP_SHAPE.cfg, chunked, A100, SP_SHAPE, times)
    assert forward == pytest.approx(expected)
    unchunked = tensor_parallel_comm(SP_SHAPE.cfg, overlap, A100, SP_SHAPE, times)
    gather, scatter, _ = _sp_collectives(overlap)
    assert unchunked[0] == pytest.approx(2 * (gather + scatter)) and forward < unchunked[0]
    assert backward == unchunked[1]
    # the final norm's gather pipelined with the head GEMM, the same closed form
    (m, n, k, b, cold), _, _ = head_gemms(SP_SHAPE.cfg, SP_SHAPE.tokens, 4)
    g, whole = gemm_time(A100, m / c, n, k, b, cold), gemm_time(A100, m, n, k, b, cold)
    ends = [head_comm(SP_SHAPE.cfg, p, A100, SP_SHAPE)[0] for p in (overlap, chunked)]
    piece = _sp_collectives(chunked, c)[0]
    assert ends[1] - ends[0] == pytest.approx(g + piece + (c - 1) * max(g, piece) - whole - gather)


def test_sp_regather_hides_behind_the_input_gradient_gemms_without_tp_overlap():
    """The runtime launches a column region's re-gather of its saved sequence shard before the input-gradient
    GEMMs whatever --tp-overlap says: backward per sublayer g's all-gather + max(0, gather - dX GEMMs) + f's
    reduce-scatter (behind the weight gradient only under --tp-overlap), plus the two norm all-reduces."""
    from parallelisms.perf.overlap import tensor_parallel_comm

    times = layer_times(A100, SP_SHAPE)
    gather, scatter, norm = _sp_collectives(SP_LAYOUT)
    expected = sum(gather + max(0.0, gather - dgrad) + scatter for dgrad in times.column_input_grads) + 2 * norm
    assert tensor_parallel_comm(SP_SHAPE.cfg, SP_LAYOUT, A100, SP_SHAPE, times)[1] == pytest.approx(expected)
    assert expected < 2 * (2 * gather + scatter) + 2 * norm


@pytest.mark.parametrize("sp", [False, True])
def test_an_moe_layer_holds_no_tp_collective_but_its_sequence_gathers(sp):
    """Experts run whole on every tp rank (parallel/moe_sequence.py): an MoE block's tp collectives are its
    attention's alone, plus under SP one all-gather of the MoE layer's input forward and one of its output's
    gradient backward (closed form). On a link of one rate without latency and nothing to hide behind, the block's
    priced seconds times that rate are the tp bytes one more layer adds to comm_per_step (the ledger's bytes)."""
    from parallelisms.perf.compute import PassTimes
    from parallelisms.perf.model import comm_per_step
    from parallelisms.perf.network import comm_time
    from parallelisms.perf.overlap import tensor_parallel_comm

    moe, parallel = PRESETS["tiny-moe"], ParallelConfig(ParallelDims(tp=2), sequence_parallel=sp)
    shape = LayerShape(moe, 4, 32, tp=2, sp=sp)
    times, e = layer_times(A100, shape), A100.bytes_per_element
    reduce, gather, scatter = (comm_time(A100, parallel, kind, "tp", shape.tokens * moe.dim * e)
                               for kind in ("all_reduce", "all_gather", "reduce_scatter"))
    norm = comm_time(A100, parallel, "all_reduce", "tp", moe.dim * e)
    regather = max(0.0, gather - times.column_input_grads[0])  # attention's, behind its input-gradient GEMMs
    expected = ((gather + scatter + gather, gather + regather + scatter + gather + 2 * norm) if sp
                else (reduce, reduce))
    assert tensor_parallel_comm(moe, parallel, A100, shape, times) == pytest.approx(expected)

    flat = dataclasses.replace(HARDWARE["cpu"], comm_cpu_fraction=0.0, collectives={
        kind: {"alpha_us": 0.0, "gbps": 1.0} for kind in ("all_reduce", "all_gather", "reduce_scatter")})
    forward, backward = tensor_parallel_comm(moe, parallel, flat, shape, PassTimes(0.0, 0.0, 0.0, 0.0, 0.0))
    train = TrainConfig(global_batch=4, seq_len=32)

    def tp_bytes(layers: int) -> float:
        volumes = comm_per_step(dataclasses.replace(moe, n_layers=layers), parallel, train, flat.bytes_per_element)
        return sum(v.bytes_per_rank for v in volumes if v.dim == "tp")
    assert (forward + backward) * 1e9 == pytest.approx(tp_bytes(3) - tp_bytes(2), rel=1e-12)


def test_data_parallel_all_reduce_bandwidth_holds_at_a_thousand_nodes():
    """Hierarchical (NVLink inside the node on the whole tensor, then each GPU's own NIC across nodes on 1/8 of
    it: rail-optimised) with tree latency where it is faster: the bandwidth term of a 1 GB all-reduce does not
    grow with the node count, its latency grows with log2 of it."""
    from parallelisms.perf.network import collective_time

    at = {nodes: collective_time(H100, "all_reduce", 1e9, 8 * nodes) for nodes in (16, 1024)}
    assert at[1024] == pytest.approx(at[16], rel=0.05)
    (a_in, b_in), (a_out, b_out) = H100.link(False), H100.link(True)
    inside = 2 * 7 * a_in + 2 * 7 / 8 * 1e9 / b_in
    across = min(2 * 1023 * a_out + 2 * 1023 / 1024 * 1e9 / 8 / b_out, 2 * 10 * a_out + 2 * 1e9 / 8 / b_out)
    assert at[1024] == pytest.approx(inside + across)


def test_ring_attention_backward_hops_carry_fp32_key_value_gradients():
    """Each backward hop sends the K/V block (16-bit) and its dK/dV accumulators, which the ring keeps in fp32
    (parallel/context.py): 6 K-sized units of 16-bit bytes against the forward hop's 2. With nothing to hide
    behind, cp - 1 forward hops and cp backward hops are exposed."""
    from parallelisms.perf.compute import PassTimes
    from parallelisms.perf.step import _layer_comm

    hw = dataclasses.replace(H100, intra_latency_us=0)
    parallel = ParallelConfig(ParallelDims(cp=2), mixed_precision="bf16")
    shape = LayerShape(PRESETS["llama3-8b"], 1, 8192, cp=2)
    forward, backward = _layer_comm(shape.cfg, parallel, hw, shape, PassTimes(0, 0, 0, 0, 0))["send/cp"]
    assert backward / forward == pytest.approx(2 * 6 / 2)
