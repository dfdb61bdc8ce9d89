"""The calibrated CPU mechanisms of the step model respond to their parameters, and GPU defaults leave them out
(no timing here: `bench predict` is the benchmark)."""

import contextlib
import dataclasses
import json

import pytest

from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.errors import ConfigError
from parallelisms.mesh import ParallelDims
from parallelisms.perf.compute import (LayerShape, _attention_core, eager_elementwise_bytes, gemm_time, layer_gemms,
                                       layer_times, sequence_parallel_copies)
from parallelisms.perf.hardware import PRESETS, load_hardware
from parallelisms.perf.network import comm_time as _comm
from parallelisms.perf.cpu import accumulation_time, gradient_copies_time
from parallelisms.perf.cpu import meetings as _meetings
from parallelisms.perf.step import Layout, _data_parallel_traffic, _gradient_shards, _layer_comm, predict_step

CPU = PRESETS["cpu"]
SMALL = preset("small")
TRAIN = TrainConfig(global_batch=8, seq_len=128)


def _step(hw, dims, **options):
    return predict_step(SMALL, ParallelConfig(dims, **options), TRAIN, hw)


@pytest.mark.fast
def test_gpu_presets_keep_the_cpu_mechanisms_off():
    for hw in (hw for hw in PRESETS.values() if not hw.cores):
        assert (hw.attention_fraction, hw.optimizer_tbps, hw.optimizer_tensor_us, hw.comm_cpu_fraction,
                hw.meeting_overhead_us, hw.overlap_overhead_us) == (1, 0, 0, 0, 0, 0)
        assert hw.ranks_per_core(64) == 1  # no cores: a device each


@pytest.mark.fast
def test_a_rank_with_several_cores_runs_its_work_over_their_threads():
    """One rank on a 4-core CPU gets 4 intra-op threads (the launcher's cores // ranks): its GEMM, memory and
    optimizer rates are 4 threads' (each measured with every core busy) and its dispatch stays one thread's.
    Measured here (2 cores, `small`, batch 8 x 128): dp 1 was predicted 272.7 ms against 167-211 measured with a
    thread's rates, 143.8 against 148-165 with two."""
    four = dataclasses.replace(CPU, cores=4)
    one = four.per_rank(1)
    assert (one.peak_tflops, one.hbm_tbps, one.optimizer_tbps) == pytest.approx(
        (4 * CPU.peak_tflops, 4 * CPU.hbm_tbps, 4 * CPU.optimizer_tbps))
    assert (one.op_overhead_us, one.optimizer_tensor_us) == (CPU.op_overhead_us, CPU.optimizer_tensor_us)
    assert four.per_rank(2).peak_tflops == pytest.approx(2 * CPU.peak_tflops)
    assert four.per_rank(4) is four and four.per_rank(8) is four and PRESETS["h100"].per_rank(1) is PRESETS["h100"]
    # the step of one rank is the step on hardware with the four threads' rates and a core of its own
    alone = _step(dataclasses.replace(one, cores=1), ParallelDims())["step_s"]
    assert _step(four, ParallelDims())["step_s"] == pytest.approx(alone)
    assert alone < 0.5 * _step(dataclasses.replace(CPU, cores=1), ParallelDims())["step_s"]


@pytest.mark.fast
def test_attention_time_scales_with_the_measured_fraction():
    shape = LayerShape(SMALL, 4, 128)
    half = dataclasses.replace(CPU, attention_fraction=CPU.attention_fraction / 2)
    assert _attention_core(half, shape)[0] == pytest.approx(2 * _attention_core(CPU, shape)[0])


@pytest.mark.fast
def test_attention_backward_is_the_measured_multiple_of_its_forward():
    """The attention kernel's backward is ``attention_backward`` times its forward (2.5 on GPUs: FlashAttention's
    FLOPs), and nothing else in the layer moves with it."""
    shape = LayerShape(SMALL, 4, 128)
    assert PRESETS["h100"].attention_backward == 2.5
    forward, backward, _ = _attention_core(CPU, shape)
    assert backward == pytest.approx(CPU.attention_backward * forward)
    slower = dataclasses.replace(CPU, attention_backward=CPU.attention_backward + 1)
    assert layer_times(slower, shape).input_grad - layer_times(CPU, shape).input_grad == pytest.approx(forward)
    assert layer_times(slower, shape).forward == layer_times(CPU, shape).forward


@pytest.mark.fast
def test_cold_operands_cost_their_bytes_at_memory_bandwidth_on_cpus_only():
    """On a CPU a GEMM waits for the operand elements it reads from memory (a weight once per pass): ``cold``
    elements add their bytes over the elementwise bandwidth; a GPU streams them under the compute (roofline)."""
    m, n, k = 128, 1376, 256
    extra = gemm_time(CPU, m, n, k, cold=n * k) - gemm_time(CPU, m, n, k)
    assert extra == pytest.approx(n * k * CPU.bytes_per_element / CPU.memory_bytes_per_s)
    gpu = PRESETS["h100"]
    assert gemm_time(gpu, m, n, k, cold=n * k) == gemm_time(gpu, m, n, k)
    # the weight gradient loads each linear's saved input; the forward and input gradient its weight
    shape = LayerShape(SMALL, 1, 128)
    warm = dataclasses.replace(CPU, cores=0, op_overhead_us=0)  # the same rates, no cold loads (nor dispatch)
    weights = SMALL.dim * (SMALL.dim + 2 * SMALL.n_kv_heads * SMALL.head_dim) + SMALL.dim ** 2 + 3 * SMALL.dim * SMALL.ffn_dim
    cold = layer_times(dataclasses.replace(CPU, op_overhead_us=0), shape)
    assert cold.weight_grad - layer_times(warm, shape).weight_grad == pytest.approx(
        4 * 128 * (3 * SMALL.dim + SMALL.ffn_dim) / CPU.memory_bytes_per_s)  # the saved inputs, once each
    forwards, input_grads, weight_grads = layer_gemms(shape)  # what layer_times prices: (m, n, k, batch, cold)
    assert sum(g[4] for g in forwards) == sum(g[4] for g in input_grads) == weights
    assert sum(g[4] for g in weight_grads) == 128 * (3 * SMALL.dim + SMALL.ffn_dim)


@pytest.mark.fast
def test_cpu_elementwise_counts_the_eager_operators():
    shape = LayerShape(SMALL, 4, 128)
    # 20 D + 11 Q + 9 K + 2 (Q + K) (grouped heads) + 5 F elements per token, 4 bytes each
    per_token = 20 * 256 + 11 * 256 + 9 * 128 + 2 * (256 + 128) + 5 * 688
    assert eager_elementwise_bytes(shape, 4) == 512 * per_token * 4
    fused = dataclasses.replace(CPU, cores=0)
    assert layer_times(CPU, shape).forward > layer_times(fused, shape).forward


@pytest.mark.fast
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


@pytest.mark.fast
def test_overlapped_collectives_cost_their_cpu_share():
    dims = ParallelDims(dp_shard=2)
    hidden = _step(dataclasses.replace(CPU, comm_cpu_fraction=0.0), dims, zero=3)
    busy = _step(dataclasses.replace(CPU, comm_cpu_fraction=1.0), dims, zero=3)
    assert busy["step_s"] > hidden["step_s"]


@pytest.mark.fast
def test_overlapped_collectives_cost_their_calls_worker_overhead():
    """Each asynchronous data-parallel call (ZeRO-3's gathers per unit and pass, its reduce-scatters, the
    gradient norm's all-reduce blocking) adds ``overlap_overhead_us`` to its exposed time; blocking ones none."""
    dims = ParallelDims(dp_shard=2)
    layout = ParallelConfig(dims, zero=3)
    base = _step(dataclasses.replace(CPU, overlap_overhead_us=0), dims, zero=3)["time_breakdown"]["exposed_comm"]
    more = _step(dataclasses.replace(CPU, overlap_overhead_us=1000), dims, zero=3)["time_breakdown"]["exposed_comm"]
    traffic = _data_parallel_traffic(SMALL, layout, TRAIN, CPU)
    for name, role, _, calls in traffic:
        added = calls * 1e-3 if role in ("gather", "reduce") else 0.0
        assert more[name] - base[name] == pytest.approx(added), name
    assert {"gather", "reduce", "scalar"} <= {role for _, role, _, _ in traffic}  # each role was checked
    assert sum(calls for _, role, _, calls in traffic if role == "gather") > 1


@pytest.mark.fast
def test_ranks_outnumbering_the_cores_make_the_step_their_cpu_work():
    """Eight ranks on two cores: the cores run whichever rank is ready, so the step is four times one rank's
    CPU work (compute, optimizer, the CPU share of every collective and the asynchronous ones' worker overhead,
    each blocking collective's meeting overhead), with no bubble; each microsecond of meeting overhead adds the
    rank's meetings four times. Two ranks keep the critical path and never pay the overhead."""
    dims, options = ParallelDims(dp_replicate=2, tp=2, pp=2), {"sequence_parallel": True, "microbatches": 4}
    step = _step(CPU, dims, **options)
    t = step["time_breakdown"]
    assert t["bubble"] == 0 and step["bubble_fraction"] == 0 and t["shared_cores"] > 0
    assert step["step_s"] == pytest.approx(t["compute"] + sum(t["exposed_comm"].values()) + t["optimizer"]
                                           + t["shared_cores"])
    layout = ParallelConfig(dims, **options)
    traffic = _data_parallel_traffic(SMALL, layout, TRAIN, CPU)
    meetings = _meetings(SMALL, layout, Layout.of(SMALL, layout, TRAIN), traffic)
    assert t["shared_cores"] == pytest.approx(4 * meetings * CPU.meeting_overhead_us * 1e-6)
    slower = dataclasses.replace(CPU, meeting_overhead_us=CPU.meeting_overhead_us + 100)
    assert _step(slower, dims, **options)["step_s"] == pytest.approx(step["step_s"] + 4 * meetings * 100e-6)
    alone = _step(dataclasses.replace(CPU, cores=8), dims, **options)  # a core each: the critical path
    assert alone["step_s"] < step["step_s"] / 2 and "shared_cores" not in alone["time_breakdown"]
    for part in ("compute", "optimizer"):
        assert t[part] == pytest.approx(4 * alone["time_breakdown"][part])
    share = 4 * CPU.comm_cpu_fraction  # every collective's CPU share: tp, the pipeline's sends, dp's overlapped or not
    assert t["exposed_comm"]["send/pp"] == pytest.approx(share * 2 * 4 * alone["per_microbatch_stage_s"]["p2p"])
    for name in ("all_gather+reduce_scatter/tp", "all_reduce/tp"):
        assert t["exposed_comm"][name] == pytest.approx(share * alone["time_breakdown"]["exposed_comm"][name])
    assert t["exposed_comm"]["all_reduce/dp"] == pytest.approx(sum(  # and 4 x the asynchronous calls' overhead
        share * s + 4 * (calls * CPU.overlap_overhead_us * 1e-6 if role == "reduce" else 0)
        for n, role, s, calls in traffic if n == "all_reduce/dp"))
    two = ParallelDims(tp=2)
    assert _step(slower, two, sequence_parallel=True)["step_s"] == _step(CPU, two, sequence_parallel=True)["step_s"]
    assert CPU.ranks_per_core(2) == 1 and CPU.ranks_per_core(8) == 4


@pytest.mark.parametrize("argv", [["--tp", "2", "--sp", "--grad-accum", "2"], ["--dp", "2", "--zero", "3"],
                                  ["--pp", "2", "--dp", "1"], ["--tp", "2", "--sp", "--tp-overlap", "--tp-overlap-chunks", "3"],
                                  ["--preset", "tiny-moe", "--tp", "2"], ["--preset", "tiny-moe", "--tp", "2", "--sp"]])
def test_meetings_are_the_collectives_the_ledger_counts(capsys, argv):
    """The blocking collectives the model charges a meeting overhead for are the calls a real run's ledger
    records per step (rank 0: the whole model, or the first pipeline stage with its one send and one receive
    per microbatch)."""
    from parallelisms.api import configure
    from parallelisms.cli import main

    argv = [*argv, "--steps", "3", "--global-batch", "4", "--seq-len", "32"]
    assert main(["train", *argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    c = configure(argv)
    traffic = _data_parallel_traffic(c.model, c.layout, c.train, CPU)
    assert sum(v["calls"] for v in report["comm"].values()) == _meetings(c.model, c.layout,
                                                                         Layout.of(c.model, c.layout, c.train), traffic)


@pytest.mark.fast
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
@pytest.mark.fast
def test_hardware_file_rejects_bad_mechanism_values(tmp_path, key, value):
    path = tmp_path / "hw.json"
    raw = {k: v for k, v in CPU.to_json().items() if k != "measurements"}
    path.write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ConfigError, match=key if key != "attention_fraction" else "at most 1"):
        load_hardware(str(path))


def _dispatched(fn, moved: tuple[str, ...] = (), outside: str = "") -> tuple[int, int]:
    """(operators ``fn`` dispatches, bytes read and written by those named in ``moved``, but those called from a
    file named ``outside``)."""
    import sys

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        ops = nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.ops += 1
            name, frame = func.__name__.split(".")[0], sys._getframe() if outside else None
            while frame is not None and not frame.f_code.co_filename.endswith(outside):
                frame = frame.f_back
            if name in moved and frame is None:  # read and written (copy_ writes its first argument unread)
                moved_tensors = (args, kwargs) if name == "copy_" else (args, kwargs, out)
                Count.nbytes += sum(t.numel() * t.element_size() for t in tree_flatten(moved_tensors)[0]
                                    if isinstance(t, torch.Tensor))
            return out
    with Count():
        fn()
    return Count.ops, Count.nbytes


def _tp_operator_counts(info):
    """Operators a tp 2 block (and the model around it) dispatches, forward and backward, with and without SP,
    and the bytes the block's concatenations move."""
    import torch

    from parallelisms.comm import CommLedger, Comms
    from parallelisms.model import build_model
    from parallelisms.parallel.tensor_plan import apply_tensor_parallel

    out = {}
    comms = Comms(ParallelDims(tp=2).build_meshes(), CommLedger())
    for sp in (False, True):
        model = apply_tensor_parallel(build_model(SMALL, 0), comms["tp"], sequence_parallel=sp)
        tokens = torch.zeros(1, 128, dtype=torch.long)
        model(tokens, tokens).backward()  # first calls set up the transports
        block, cos, sin = model.layers["0"], model.rope_cos[:128], model.rope_sin[:128]
        h = torch.randn(1, 64 if sp else 128, SMALL.dim, requires_grad=True)
        y = []
        forward, cat_f = _dispatched(lambda: y.append(block(h, cos, sin)), ("cat",))
        backward, cat_b = _dispatched(lambda: y[0].backward(torch.ones_like(y[0])), ("cat",))
        loss = []
        model_f = _dispatched(lambda: loss.append(model(tokens, tokens)))[0]
        model_b = _dispatched(lambda: loss[0].backward())[0]
        out[sp] = (forward, backward, model_f - SMALL.n_layers * forward, model_b - SMALL.n_layers * backward,
                   cat_f, cat_b)
    return out


def test_tensor_parallel_operator_counts_are_what_a_tp_block_dispatches():
    """The operators compute.py charges a tp 2 block and the ends (with and without SP) are what they dispatch
    (within 5% or 5 operators: the ends are the model's count less four blocks', and counts move with torch
    versions)."""
    from parallelisms.launch import launch
    from parallelisms.perf.compute import block_ops, head_ops

    counts = launch(_tp_operator_counts, 2, backend="gloo", threads=1)[0]
    for sp, (forward, backward, ends_f, ends_b, cat_f, cat_b) in counts.items():
        expected = (*block_ops("swiglu", 2, sp), *head_ops(2, sp))
        got = (forward, backward, ends_f, ends_b)
        assert all(abs(g - want) <= max(5, 0.05 * want) for g, want in zip(got, expected)), (sp, got, expected)
        # the sequence's concatenations copy what sequence_parallel_copies charges (none without SP)
        assert (cat_f, cat_b) == sequence_parallel_copies(LayerShape(SMALL, 1, 128, tp=2, sp=sp), 4)


def _moe_operator_counts(info):
    """Operators an MoE block (`small` with 8 experts of top 2) dispatches forward and backward (its output's
    gradient and the auxiliary loss's), whole and at tp 2 with and without SP."""
    import torch

    from parallelisms.comm import CommLedger, Comms
    from parallelisms.model import build_model
    from parallelisms.parallel.tensor_plan import apply_tensor_parallel

    cfg, out = dataclasses.replace(SMALL, n_experts=8, top_k=2), {}
    comms = Comms(ParallelDims(tp=2).build_meshes(), CommLedger())
    tokens = torch.zeros(1, 128, dtype=torch.long)
    for tp, sp in ((1, False), (2, False), (2, True)):
        model = build_model(cfg, 0)
        if tp > 1:
            model = apply_tensor_parallel(model, comms["tp"], sequence_parallel=sp)
        model(tokens, tokens).backward()  # first calls set up the transports
        block, cos, sin = model.layers["0"], model.rope_cos[:128], model.rope_sin[:128]
        h, y = torch.randn(1, 64 if sp else 128, cfg.dim, requires_grad=True), []
        forward = _dispatched(lambda: y.append(block(h, cos, sin)))[0]
        grads = [torch.ones_like(y[0]), torch.tensor(cfg.aux_loss_coef)]
        backward = _dispatched(lambda: torch.autograd.backward([y[0], block.feed_forward.aux_loss], grads))[0]
        out[tp, sp] = (forward, backward)
    return out


def test_moe_operator_counts_are_what_an_moe_block_dispatches():
    """The operators compute.py charges an MoE block on a CPU, whole and at tp 2 with and without SP (the
    layer's own all-gather and split), are what the block dispatches (within 5% or 5 operators, as above)."""
    from parallelisms.launch import launch
    from parallelisms.perf.compute import block_ops

    counts = launch(_moe_operator_counts, 2, backend="gloo", threads=1)[0]
    for (tp, sp), got in counts.items():
        expected = block_ops("swiglu", tp, sp, moe=True)
        assert all(abs(g - want) <= max(5, 0.05 * want) for g, want in zip(got, expected)), (tp, sp, got, expected)
        assert expected != block_ops("swiglu", tp, sp)  # not the dense block's


@pytest.mark.fast
def test_an_moe_block_prices_its_own_operators_on_cpus_only():
    """On a CPU an MoE block's routing operators add to a dense block's, under tp its own comm-layer ones
    replace the dense block's; a GPU's block charges its collective calls alone."""
    from parallelisms.perf.compute import block_ops
    from parallelisms.perf.cpu import MOE_BLOCK_OPS, TP_MOE_BLOCK_OPS

    dense = block_ops("swiglu")
    assert block_ops("swiglu", moe=True) == tuple(d + m for d, m in zip(dense, MOE_BLOCK_OPS))
    for sp in (False, True):
        extra = TP_MOE_BLOCK_OPS["sp" if sp else "tp"]
        assert block_ops("swiglu", 2, sp, moe=True) == tuple(d + m + e for d, m, e in zip(dense, MOE_BLOCK_OPS, extra))
        assert block_ops("swiglu", 2, sp, device=True, moe=True) < block_ops("swiglu", 2, sp, device=True)
    moe = dataclasses.replace(SMALL, n_experts=8, top_k=2)
    shape = LayerShape(moe, 1, 128, tp=2, sp=True)
    priced = layer_times(CPU, shape).forward - layer_times(dataclasses.replace(CPU, op_overhead_us=0.0), shape).forward
    assert priced == pytest.approx(block_ops("swiglu", 2, True, moe=True)[0] * CPU.op_overhead_us * 1e-6)


def _sp_copies(info):
    """Bytes a tp 2 SP block's copies (concatenations, clones, copies into place) move forward and backward on two
    sequences, its forward collectives whole and in 2 and 3 pieces (--tp-overlap --tp-overlap-chunks C); not the
    shared-memory transport's own (the collective's CPU work, asynchronous ones on the comm worker's thread)."""
    import torch

    from parallelisms.comm import CommLedger, Comms
    from parallelisms.model import build_model
    from parallelisms.parallel.tensor_plan import apply_tensor_parallel

    out, comms = {}, Comms(ParallelDims(tp=2).build_meshes(), CommLedger())
    for chunks in (1, 2, 3):
        model = apply_tensor_parallel(build_model(SMALL, 0), comms["tp"], sequence_parallel=True, overlap=True,
                                      chunks=chunks)
        block, cos, sin = model.layers["0"], model.rope_cos[:128], model.rope_sin[:128]
        h, y, copies = torch.randn(2, 64, SMALL.dim, requires_grad=True), [], ("cat", "clone", "copy_")
        block(h, cos, sin).sum().backward()  # first calls set up the transports
        forward = _dispatched(lambda: y.append(block(h, cos, sin)), copies, "shm.py")[1]
        backward = _dispatched(lambda: y[0].backward(torch.ones_like(y[0])), copies, "shm.py")[1]
        out[chunks] = (forward, backward)
    return out


def test_chunked_sequence_parallel_copies_are_what_the_pieces_copy():
    """--tp-overlap-chunks C under SP: the forward's concatenations give way to copies of the GEMMs' input and
    output pieces (parallel/tensor.py), whatever C; sequence_parallel_copies charges the difference a tp 2 block
    measures (the backward, unchunked, unchanged), and layer_times carries it."""
    from parallelisms.launch import launch

    measured = launch(_sp_copies, 2, backend="gloo", threads=1)[0]
    model = {c: sequence_parallel_copies(LayerShape(SMALL, 2, 128, tp=2, sp=True, chunks=c), 4) for c in (1, 2, 3)}
    assert model[2] == model[3] and model[2][0] != model[1][0]
    for c in (2, 3):
        assert measured[c][0] - measured[1][0] == pytest.approx(model[c][0] - model[1][0], abs=1), c
        assert measured[c][1] == measured[1][1] and model[c][1] == model[1][1]
    shapes = [LayerShape(SMALL, 2, 128, tp=2, sp=True, chunks=c) for c in (1, 2)]
    extra = (model[2][0] - model[1][0]) / CPU.memory_bytes_per_s
    assert layer_times(CPU, shapes[1]).forward - layer_times(CPU, shapes[0]).forward == pytest.approx(extra)


def test_accumulation_is_what_autograd_adds_for_a_later_microbatch():
    """A block's second backward adds its weight gradients to the first's (AccumulateGrad's add_: read two,
    write one), the bytes accumulation_time prices per microbatch after a step's first; the first adds none;
    GPUs (gradient-accumulation fusion) are charged nothing; the step's weight-gradient time carries it."""
    import torch

    from parallelisms.model import build_model
    from parallelisms.perf.compute import head_times

    model = build_model(SMALL, 0)
    block, cos, sin = model.layers["0"], model.rope_cos[:128], model.rope_sin[:128]
    h = torch.randn(1, 128, SMALL.dim)
    added = [_dispatched(lambda: block(h, cos, sin).sum().backward(), ("add_",))[1] for _ in range(2)]
    shape = LayerShape(SMALL, 1, 128)
    one_layer = accumulation_time(CPU, shape, 1) - accumulation_time(CPU, shape, 0)
    assert added[0] == 0 and added[1] == pytest.approx(one_layer * CPU.memory_bytes_per_s)
    model.zero_grad(set_to_none=True)  # the whole model holds both vocabulary tables (embedding and output)
    tokens = torch.randint(0, SMALL.vocab_size, (1, 128))
    added = [_dispatched(lambda: model(tokens, tokens).backward(), ("add_",))[1] for _ in range(2)]
    assert added[1] - added[0] == pytest.approx(accumulation_time(CPU, shape, SMALL.n_layers, 2) * CPU.memory_bytes_per_s)
    gpu = [predict_step(SMALL, ParallelConfig(ParallelDims()), TrainConfig(global_batch=2 * m, seq_len=128, grad_accum=m),
                        PRESETS["h100"])["per_microbatch_stage_s"]["weight_grad"] for m in (1, 4)]
    assert gpu[0] == gpu[1]  # a GPU's weight-gradient GEMM accumulates in place: nothing more
    four = TrainConfig(global_batch=8, seq_len=128, grad_accum=4)  # two sequences per microbatch
    weight_grad = predict_step(SMALL, ParallelConfig(ParallelDims()), four, CPU)["per_microbatch_stage_s"]["weight_grad"]
    shape, rank = LayerShape(SMALL, 2, 128), CPU.per_rank(1)  # one rank: both cores' threads
    own = SMALL.n_layers * layer_times(rank, shape).weight_grad + head_times(rank, SMALL, 256, 1).weight_grad
    assert weight_grad - own == pytest.approx(3 / 4 * accumulation_time(rank, shape, SMALL.n_layers, 2))


# what a step's gradient sync moves beyond the plain model's backward: reads and writes of these operators
_GRADIENT_OPS = ("mul", "div_", "cat", "copy_", "zero_", "add_")


def _moved_bytes(fn) -> int:
    """Bytes ``fn`` reads and writes through :data:`_GRADIENT_OPS`: every tensor argument read (but the
    destination of ``copy_`` and ``zero_``, only written; ``out=`` is only written) and the result written."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor))

    class Count(TorchDispatchMode):
        moved = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if name in _GRADIENT_OPS:
                read = args[1:] if name in ("copy_", "zero_") else args
                Count.moved += nbytes(read) + nbytes(out)
            return out
    with Count():
        fn()
    return Count.moved


def _gradient_sync_bytes(info, layouts):
    """Per layout: bytes a step's backward and gradient sync move through :data:`_GRADIENT_OPS` beyond the
    plain model's backward over the same microbatches (2 ranks, 4 sequences a rank)."""
    import torch

    from parallelisms.comm import Comms
    from parallelisms.model import build_model
    from parallelisms.parallel.grad_sync import LocalGradients
    from parallelisms.data.loader import microbatches
    from parallelisms.train_setup import _grad_sync

    tiny = preset("tiny")
    tokens = torch.randint(0, tiny.vocab_size, (4, 32))

    def moved(model, sync, m):
        def step(count):
            sync.zero_grad()
            total = 0
            for i, (x, y) in enumerate(microbatches(tokens, tokens, m)):
                with sync.no_sync() if i < m - 1 else contextlib.nullcontext():
                    loss = model(x, y) / m
                    total += count(loss.backward)
            return total + count(sync.finish)
        for _ in range(2):  # DDP rebuilds its buckets in the second step's forward (its backward accumulates)
            step(lambda fn: fn() or 0)
        return step(_moved_bytes)

    out = []
    for parallel, m in layouts:
        plain = build_model(tiny, 0)
        base = moved(plain, LocalGradients(plain, Comms()), m)
        model = build_model(tiny, 0)
        comms = Comms(parallel.dims.build_meshes())
        out.append(moved(model, _grad_sync(model, {}, set(), parallel, TrainConfig(global_batch=8, seq_len=32), comms), m)
                   - base)
    return out


def test_gradient_copies_are_what_the_engines_move():
    """The bytes gradient_copies_time prices (DDP's copy into its buckets, the flat engine's concatenation and
    division, per-parameter FSDP's send buffer; once a step or per microbatch) are what each engine's backward
    and finish move beyond the plain model's backward (read and written, the operators' own tensors), and GPUs
    are charged none."""
    from parallelisms.launch import launch

    layouts = [(ParallelConfig(ParallelDims(dp_replicate=2)), 1), (ParallelConfig(ParallelDims(dp_shard=2), zero=3), 1),
               (ParallelConfig(ParallelDims(dp_shard=2), fsdp="shard_grad_op", fsdp_style="per_param"), 1),
               (ParallelConfig(ParallelDims(dp_replicate=2)), 2), (ParallelConfig(ParallelDims(dp_shard=2), zero=1), 2),
               (ParallelConfig(ParallelDims(dp_shard=2), zero=2), 2), (ParallelConfig(ParallelDims(dp_shard=2), zero=3), 2)]
    moved = launch(_gradient_sync_bytes, 2, layouts, backend="gloo", threads=1)[0]
    tiny = preset("tiny")
    accumulated = accumulation_time(CPU, LayerShape(tiny, 2, 32), tiny.n_layers, 2)  # the plain model's, later microbatches
    for (parallel, m), extra in zip(layouts, moved):
        sharded = parallel.zero in (2, 3)  # a later microbatch adds its reduced half into the shard's gradient instead
        expected = gradient_copies_time(tiny, parallel, m, CPU, _gradient_shards(parallel)) - sharded * (m - 1) * accumulated / 2
        assert extra == pytest.approx(expected * CPU.memory_bytes_per_s), (parallel.label(), m)
    # the step prices the sharded accumulation at 1/N of the plain one
    zero2 = ParallelConfig(ParallelDims(dp_shard=2), zero=2)
    train = TrainConfig(global_batch=8, seq_len=32, grad_accum=2)
    without = predict_step(tiny, zero2, train, CPU)["per_microbatch_stage_s"]["weight_grad"]
    plain = dataclasses.replace(zero2, dims=ParallelDims(dp_replicate=2), zero=0)
    ddp = predict_step(tiny, plain, train, CPU)["per_microbatch_stage_s"]["weight_grad"]
    copies = {p: gradient_copies_time(tiny, p, 2, CPU, _gradient_shards(p)) / 2 for p in (zero2, plain)}
    assert (ddp - copies[plain]) - (without - copies[zero2]) == pytest.approx(accumulated / 2 / 2)
    ddp, alone = (predict_step(tiny, p, TrainConfig(global_batch=g, seq_len=32), PRESETS["h100"])
                  ["per_microbatch_stage_s"]["weight_grad"] for p, g in ((layouts[0][0], 8), (ParallelConfig(ParallelDims()), 4)))
    assert ddp == alone  # a GPU's engine reduces gradients where the backward writes them: no copy


def _optimizer_tensor_counts(info, layouts):
    """Per layout: the parameter tensors this rank's optimizers step (the trainer :func:`parallelize` builds)."""
    from parallelisms.comm import Comms
    from parallelisms.model import build_model
    from parallelisms.training import parallelize

    out = []
    for parallel in layouts:
        trainer = parallelize(build_model(SMALL, 0), parallel, TrainConfig(global_batch=8, seq_len=32),
                              Comms(parallel.dims.build_meshes()))
        out.append(sum(len(group["params"]) for opt in trainer.optimizers for group in opt.param_groups))
        trainer.close()
    return out


def test_optimizer_tensors_are_what_the_busiest_rank_steps():
    """The per-tensor part of the optimizer's time counts the tensors the busiest rank's optimizer holds: per
    parameter without sharding (a pipeline stage holds one end, a V-shaped schedule's first rank both), one flat
    shard per unit under ZeRO and flat FSDP (the blocks, the embedding and the head; a stage its own)."""
    from parallelisms.launch import launch
    from parallelisms.perf.step import _optimizer_tensors

    pp = {"microbatches": 4}
    layouts = [ParallelConfig(ParallelDims(dp_replicate=2)), ParallelConfig(ParallelDims(dp_shard=2), zero=3),
               ParallelConfig(ParallelDims(pp=2), schedule="1f1b", **pp),
               ParallelConfig(ParallelDims(pp=2), schedule="zb-v", **pp),
               ParallelConfig(ParallelDims(dp_shard=2), zero=2),
               ParallelConfig(ParallelDims(dp_shard=2, pp=2), schedule="1f1b", zero=1, **pp),
               ParallelConfig(ParallelDims(dp_shard=2, pp=2), schedule="zb-v", zero=3, **pp)]
    two, four = (launch(_optimizer_tensor_counts, n, [p for p in layouts if p.dims.world_size == n],
                        backend="gloo", threads=1) for n in (2, 4))
    counts = [max(rank[i] for rank in two) for i in range(5)] + [max(rank[i] for rank in four) for i in range(2)]
    assert counts == [_optimizer_tensors(SMALL, p, TrainConfig(global_batch=8, seq_len=32)) for p in layouts]
    # ZeRO-1/2 merge units under --bucket-mb: a cap below one block's bytes keeps every unit apart
    assert _optimizer_tensors(SMALL, layouts[4], TrainConfig(global_batch=8, seq_len=32, bucket_mb=1)) == 6
