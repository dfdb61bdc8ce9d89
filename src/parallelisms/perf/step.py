"""One training step, predicted from its mechanisms: per-layer compute (compute.py), each collective where it
sits on the critical path (network.py), the pipeline schedule simulated with the stage's own F/B/W and p2p
times, the optimizer, and the memory per rank.

Where each collective goes (spec: "Critical path and latency hiding"):

* tensor/sequence parallel: two collectives per block forward and two backward (an MoE layer's experts run
  whole on every tp rank: none, or under SP one all-gather each way), each where the runtime puts it
  (perf.overlap): ``--tp-overlap`` hides the backward's input-gradient collective behind the weight-gradient
  GEMM as far as that GEMM lasts, SP's re-gather of a column region's input runs behind its input-gradient
  GEMMs, and ``--tp-overlap-chunks C`` pipelines each forward collective with its GEMM over C chunks (the
  first chunk's GEMM or collective and the last's exposed, plus the chunking's cost: C smaller GEMMs and C
  latencies); with SP also the all-reduce of each norm weight's gradient (Korthikanti et al. 2023, Sec. 4.2.2);
* data parallel (DDP, ZeRO-1/2, FSDP): gradient reductions run bucket by bucket during the backward of the
  last microbatch; only what exceeds it, and the last bucket, is exposed (on a CPU each asynchronous call also
  costs the rank ``hw.overlap_overhead_us``: its comm worker shares the core). ZeRO-3/FSDP gather each unit's
  parameters ``--fsdp-prefetch`` units ahead (perf.prefetch), and without a pipeline the gathers and the
  gradient reduce-scatters share the group's link (perf.prefetch.shared_link). ZeRO-1/2 gather
  the updated parameters after the optimizer, exposed, or with ``--overlap-param-gather`` (Megatron-LM's
  distributed optimizer) bucket by bucket under the next step's first forward: the first bucket, and what
  outlasts that forward, exposed;
* context parallel: ring attention sends one K/V block per hop while the previous block's attention runs
  (Liu et al. 2023: hidden when the block's compute outlasts the hop); Ulysses' all-to-alls are exposed;
* expert parallel: dispatch and combine all-to-alls, two each way per MoE layer, exposed (DualPipe: under the
  paired chunk's compute);
* pipeline: the schedule simulator (Qi et al. 2024's cost model) with these F, B, W and p2p times gives the
  makespan, so interleaved, zero-bubble and DualPipe schedules come out of their own orders;
* optimizer: Adam reads and writes its fp32 state once per step (memory-bound);
* a CPU (``hw.kind``: the CPU hardware adapter, perf.cpu): the gradient work on the rank's core (accumulation,
  the engines' buffer copies) and, where ranks outnumber the cores, the step as one rank's CPU work times the
  ranks per core, where that exceeds the critical path.

Memory per rank: model states per ZeRO stage / FSDP strategy (Rajbhandari et al. 2020), activations per
layer per recompute mode (Korthikanti et al. 2023, Table 2, with the MLP's own width and GQA) times the
microbatches in flight on the busiest rank (from the simulator), gradient buckets, ZeRO-3's gathered layers
and the fp32 logits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.options import FsdpStrategy, FsdpStyle, Precision, Recompute, Schedule
from parallelisms.perf import cpu
from parallelisms.perf.buckets import ddp_buckets
from parallelisms.perf.compute import FOREACH_ADAMW_BYTES, FUSED_ADAMW_BYTES, LayerShape, PassTimes, head_times, layer_times
from parallelisms.perf.hardware import Hardware
from parallelisms.parallel.pipeline.schedules import V_SHAPED
from parallelisms.parallel.wrap import merged_units
from parallelisms.perf.model import (block_params, comm_per_step, flat_mixed_precision, microbatches_per_step,
                                     mirror_gradient_bytes, model_flops_per_token, model_state_bytes, pipedream_updates,
                                     rank0_holds_head, sharding_stage, vocab_rows)
from parallelisms.perf.network import collective_time, comm_time, group
from parallelisms.perf.overlap import behind, head_comm, tensor_parallel_comm
from parallelisms.perf.context import context_times
from parallelisms.perf.prefetch import shared_link
from parallelisms.perf.stages import busiest_rank, pipeline_ranks, schedule_of

CLOSED_FORM_PEAK = {Schedule.GPIPE: None, Schedule.ONE_F_ONE_B: 1.0, Schedule.ZB_H1: 1.0, Schedule.ZB_H2: 2.0,
                    Schedule.INTERLEAVED: 1.0}


@dataclass(frozen=True)
class Layout:
    """Sizes derived from a layout: microbatches, sequences per microbatch, layers per stage, group strides."""
    m: int
    batch: int
    layers: int
    dp: int

    @staticmethod
    def of(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> "Layout":
        dims = parallel.dims
        m = microbatches_per_step(parallel, train)
        return Layout(m, max(1, train.global_batch // (dims.dp * m)), math.ceil(cfg.n_layers / dims.pp), dims.dp)


def _layer_comm(cfg, parallel, hw, shape: LayerShape, times: PassTimes) -> dict:
    """Exposed seconds per layer per microbatch of tp, cp and ep collectives: {(kind/dim): (forward, backward)}."""
    dims, e, out = parallel.dims, hw.bytes_per_element, {}
    if dims.tp > 1:  # per sublayer (attention, MLP): Megatron's f and g (perf.overlap)
        name = "all_gather+reduce_scatter/tp" if parallel.sequence_parallel else "all_reduce/tp"
        out[name] = tensor_parallel_comm(cfg, parallel, hw, shape, times)
    if dims.cp > 1:
        kv, q = (shape.tokens * width / dims.tp * e for width in (cfg.n_kv_heads * cfg.head_dim, cfg.q_dim))
        out.update(context_times(hw, cfg, parallel, q, kv, times.attention_core, behind, e))  # the mode's (perf.context)
    if dims.ep > 1 and cfg.n_experts:
        routed = shape.tokens * cfg.top_k * cfg.dim * e
        a2a = comm_time(hw, parallel, "all_to_all", "ep", 2 * routed, calls=2)
        if dims.pp > 1 and parallel.schedule.dual:
            # F&B chunks: one microbatch's dispatch and combine run under another's backward, and back
            # (DeepSeek-V3 report, Sec. 3.2.1); the warm-up and cool-down chunks, not paired, are ignored here
            out["all_to_all/ep"] = (behind(hw, a2a, times.input_grad + times.weight_grad),
                                    behind(hw, a2a, times.forward))
        else:
            out["all_to_all/ep"] = (a2a, a2a)
    return out


def _bubble(parallel: ParallelConfig, m: int, t_f: float, t_b: float, t_w: float, t_comm: float,
            simulate_schedule: bool) -> tuple[float, float, float]:
    """(pipeline seconds, bubble fraction, microbatches in flight on the busiest rank) for m microbatches."""
    pp, name = parallel.dims.pp, parallel.schedule
    busy = m * (t_f + t_b + t_w)
    if pp == 1:
        return busy, 0.0, 1.0
    chunks = parallel.chunks if name is Schedule.INTERLEAVED else (2 if name in V_SHAPED else 1)
    if not simulate_schedule and name in CLOSED_FORM_PEAK:  # the closed forms (plan's first pass)
        bubble = (pp - 1) * ({Schedule.ZB_H1: t_f + t_b - t_w, Schedule.ZB_H2: t_f + t_b - 2 * t_w}.get(name, t_f + t_b + t_w)
                             / chunks + 2 * t_comm)
        bubble = max(bubble, 0.0)
        peak = m if name is Schedule.GPIPE else CLOSED_FORM_PEAK[name] * pp * (1 + (pp - 1) / (pp * chunks) if chunks > 1 else 1)
        return busy + bubble, bubble / (busy + bubble), min(peak, m)
    from parallelisms.parallel.pipeline.simulate import Times, simulate

    result = simulate(schedule_of(name, pp, m, parallel.chunks), Times(t_f, t_b, t_w, t_comm))
    span = max(result.spans)
    return span, result.bubble_rate, max(result.peak_activations)


def _cached(cache: dict | None, key, compute):
    """``compute()``, remembered in ``cache`` under ``key`` (plan prices thousands of similar layouts)."""
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def predict_step(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hw: Hardware,
                 attention: str = "flash", simulate_schedule: bool = True, cache: dict | None = None,
                 fp8: bool = False, kernels: str = "eager") -> dict:
    """The estimate's fields (see the module docstring) for one layout on ``hw``; ``cache`` (a dict kept
    across calls with the same model and hardware) reuses per-layer and data-parallel times; ``fp8`` prices
    the blocks' linear layers in FP8; ``kernels`` how a GPU runs the non-GEMM work, ``eager`` (this runtime's
    operators) or ``fused`` (Megatron-LM's kernels; compute.KERNELS)."""
    dims, lay = parallel.dims, Layout.of(cfg, parallel, train)
    hw = hw.per_rank(dims.world_size)  # a CPU rank with several threads
    shape = LayerShape(cfg, lay.batch, train.seq_len, dims.tp, parallel.sequence_parallel, dims.cp, dims.ep, attention,
                       fp8, kernels, max(1, parallel.tp_overlap_chunks) if parallel.tp_overlap else 1)

    def per_layer():
        layer = layer_times(hw, shape)
        head = head_times(hw, cfg, shape.tokens, dims.tp, parallel.sequence_parallel, kernels)
        return layer, head, _layer_comm(cfg, parallel, hw, shape, layer)
    layer, head, comm = _cached(cache, ("layer", shape, dims, parallel.tp_overlap, parallel.tp_overlap_chunks,
                                        parallel.cp_attention), per_layer)
    recompute = {Recompute.FULL: layer.forward, Recompute.SELECTIVE: layer.attention_core}.get(parallel.recompute, 0.0)
    comm_f, comm_b = sum(f for f, _ in comm.values()), sum(b for _, b in comm.values())
    head_f, head_b = head_comm(cfg, parallel, hw, shape)
    layer_b = layer.input_grad + recompute + comm_b + (comm_f if parallel.recompute is Recompute.FULL else 0)
    busiest = busiest_rank(pipeline_ranks(cfg, parallel, lay.m), layer.forward + comm_f + layer_b + layer.weight_grad,
                           head.forward + head_f + head.input_grad + head_b + head.weight_grad)
    n, ends = busiest.layers, busiest.head  # the busiest stage: its layers, and the head where it holds it
    lay = dataclasses.replace(lay, layers=n)
    t_f = n * (layer.forward + comm_f) + ends * (head.forward + head_f)
    t_b = n * layer_b + ends * (head.input_grad + head_b)
    t_w = n * layer.weight_grad + ends * head.weight_grad
    if hw.kind == "cpu":  # gradients added and copied on the rank's core (perf.cpu)
        t_w = _with_cpu_gradient_work(cfg, parallel, hw, shape, lay.m, n, t_w)
    p2p_bytes = shape.tokens * cfg.dim * hw.bytes_per_element / (dims.tp if parallel.sequence_parallel else 1)
    t_comm = comm_time(hw, parallel, "send", "pp", p2p_bytes) if dims.pp > 1 else 0.0
    pipeline_s, bubble, in_flight = _bubble(parallel, lay.m, t_f, t_b, t_w, t_comm, simulate_schedule)

    exposed = {f"{k}": lay.m * n * (f + b + (f if parallel.recompute is Recompute.FULL else 0)) for k, (f, b) in comm.items()}
    if ends and head_f + head_b:
        exposed["all_reduce/tp"] = exposed.get("all_reduce/tp", 0.0) + lay.m * (head_f + head_b)
    traffic = _cached(cache, ("dp", dims, parallel.zero, parallel.fsdp, parallel.fsdp_style, parallel.mixed_precision,
                              parallel.overlap_param_gather, train.bucket_mb, train.dtype),
                      lambda: _data_parallel_traffic(cfg, parallel, train, hw))
    table = vocab_rows(cfg, dims.tp) * cfg.dim  # the wrapped units: the embedding, the blocks, the head
    units = ([(table, 0.0, 0.0)] + [(block_params(cfg, dims.tp), layer.forward + comm_f, layer_b + layer.weight_grad)] * n
             + [(table + cfg.dim, head.forward + head_f, head.input_grad + head_b + head.weight_grad)])
    exposed.update(_data_parallel_exposed(traffic, cfg, lay, t_f, t_b + t_w, hw, dims.pp, units, parallel.fsdp_prefetch))
    if dims.pp > 1 and parallel.schedule is Schedule.DUALPIPE:  # the two copies' gradients, summed after the step
        exposed["send/pp"] = comm_time(hw, parallel, "send", "pp", mirror_gradient_bytes(cfg, parallel))
    optimizer_s = _optimizer_time(cfg, parallel, train, hw, kernels)
    step_s = pipeline_s + sum(v for k, v in exposed.items() if not k.endswith(("/tp", "/cp", "/ep"))) + optimizer_s
    compute_s = lay.m * (t_f + t_b + t_w) - sum(v for k, v in exposed.items() if k.endswith(("/tp", "/cp", "/ep")))

    breakdown = {"compute": compute_s, "exposed_comm": exposed, "bubble": pipeline_s - lay.m * (t_f + t_b + t_w),
                 "optimizer": optimizer_s}
    stage_s = {"forward": t_f, "input_grad": t_b, "weight_grad": t_w, "p2p": t_comm}
    if hw.kind == "cpu":  # ranks outnumbering the cores run whichever is ready (perf.cpu)
        step_s, breakdown, stage_s, bubble = cpu.cores_step(cfg, parallel, lay, hw, traffic, 2 * lay.m * t_comm if
                                                            dims.pp > 1 else 0.0, (step_s, breakdown, stage_s, bubble))

    tokens = train.global_batch * train.seq_len
    world = dims.world_size
    model_flops = model_flops_per_token(cfg, train.seq_len) * tokens
    extra = {Recompute.FULL: layer.forward_flops, Recompute.SELECTIVE: 4 * cfg.n_heads / dims.tp * shape.tokens *
             train.seq_len * cfg.head_dim}.get(parallel.recompute, 0.0)
    hardware_flops = model_flops + extra * dims.tp * dims.cp * cfg.n_layers * lay.m * lay.dp
    memory = memory_per_rank(cfg, parallel, train, hw, lay, in_flight, attention)
    return {
        "step_s": step_s, "tokens_per_s": tokens / step_s,
        "mfu": model_flops / (step_s * world * hw.peak_flops),
        "hfu": hardware_flops / (step_s * world * hw.peak_flops),
        "model_tflops_per_gpu": model_flops / step_s / world / 1e12,
        "hardware_tflops_per_gpu": hardware_flops / step_s / world / 1e12,
        "bubble_fraction": bubble, "memory_per_rank": memory, "fits": memory["total"] <= hw.memory_bytes,
        "time_breakdown": breakdown, "per_microbatch_stage_s": stage_s,
        "layer_s": {"forward": layer.forward, "backward": layer.input_grad + layer.weight_grad + recompute,
                    "tp_comm_forward": comm_f, "tp_comm_backward": comm_b},
    }


def _with_cpu_gradient_work(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware, shape: LayerShape, m: int,
                            layers: int, t_w: float) -> float:
    """A CPU rank's weight-gradient seconds per microbatch ``t_w`` with its gradient work (perf.cpu): every
    microbatch after a step's first adds its weight gradients to the held ones (the embedding's too where the
    rank holds both ends; sharded gradients: the reduced 1/N shards), and the data-parallel engine copies
    gradients into its buffers."""
    shards = _gradient_shards(parallel)
    if m > 1:
        t_w += (m - 1) / m * cpu.accumulation_time(hw, shape, layers, 1 + rank0_holds_head(parallel)) / shards
    return t_w + cpu.gradient_copies_time(cfg, parallel, m, hw, shards) / m


def _data_parallel_traffic(cfg, parallel, train, hw) -> list[tuple[str, str, float, int]]:
    """(name, role, seconds, calls) of each data-parallel (and expert-replica) collective per step, from the
    ledger-exact volumes; role: ``scalar`` (the gradient norm), ``gather`` (ZeRO-3/FSDP parameters),
    ``update`` (ZeRO-1/2's gather after the optimizer; ``overlapped_update`` under the next forward) or ``reduce``
    (gradients, bucket by bucket; ``reduce_each``: sharded gradients, every microbatch's backward) or ``copies``
    (EPLB's redundant experts summing their gradients over ep, one blocking call after the reduction). The
    calls are the engine's (:func:`_engine_calls`) or DDP's buckets (:func:`parallelisms.perf.buckets.ddp_buckets`),
    else one per ``--bucket-mb`` of gradients."""
    out = []
    sharded_params = sharding_stage(parallel) == 3
    engine = {"dp": _engine_calls(cfg, parallel, train), "ep_replicate": _engine_calls(cfg, parallel, train, True)}
    ddp = {} if engine["dp"] else ddp_buckets(cfg, parallel, train)  # DDP: a call per bucket and reducing group
    bucket = train.bucket_mb * 2**20
    m = _microbatches_reduced(parallel, train)
    for v in comm_per_step(cfg, parallel, train, parallel.mixed_precision.compute_bytes, pipeline=False):
        # EPLB's copies' gradients: one call after the layout's reduction, exposed whole (the norm's scalar is not)
        copies = v.dim == "ep" and v.kind == "all_reduce" and v.bytes_per_rank >= 64
        per_layer = v.dim in ("tp", "pp", "ep") or v.dim.startswith("cp")  # priced per layer: cp_inner too
        if (per_layer and not copies) or v.bytes_per_rank <= 0:
            continue
        n, stride = group(parallel, _link_dim(parallel, v))
        if n <= 1:
            continue
        full = v.bytes_per_rank / ({"all_reduce": 2}.get(v.kind, 1) * (n - 1) / n)
        calls = (1 if full < 64 or copies else ddp.get(v.dim, 1) if ddp
                 else engine.get("dp" if v.dim.startswith("dp") else v.dim, {}).get(v.kind) or max(1, math.ceil(full / bucket)))
        role = ("scalar" if full < 64 else "copies" if copies else "gather" if v.kind == "all_gather" and sharded_params
                else ("overlapped_update" if parallel.overlap_param_gather else "update") if v.kind == "all_gather"
                else "reduce_each" if m > 1 and _gradient_shards(parallel) > 1 else "reduce")
        out.append((f"{v.kind}/{v.dim}", role, collective_time(hw, v.kind, full, n, stride, calls), calls))
    return out


def _microbatches_reduced(parallel: ParallelConfig, train: TrainConfig) -> int:
    """Microbatches whose backward a flat engine reduces (and whose forward gathers) without a pipeline; under
    one a stage's engine holds its units through the step (``hold_through_step``): once per step."""
    return microbatches_per_step(parallel, train) if parallel.dims.pp == 1 and parallel.fsdp_style is FsdpStyle.FLAT else 1


def _engine_calls(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                  experts: bool = False) -> dict[str, int]:
    """The data-parallel calls per step of a sharding engine over its wrapped units (:func:`_stage_units`,
    ZeRO-1/2's merged under ``--bucket-mb`` by :func:`merged_units`), by collective kind, as its hooks issue
    them (parallel/flat.py, fsdp2.py, yafsdp.py): a reduce-scatter per unit and reduced microbatch (gradients
    sharded: every microbatch; else the last), and under HSDP an all-reduce of each reduced shard across the
    replicas; sharded parameters gathered per unit before each forward, and again before each backward where
    the forward freed them (FULL_SHARD, ZeRO-3: not the head, whose backward follows its forward, nor the
    embedding, whose backward reads no weight, in the per-parameter styles; under buffer reuse not the last
    block either, still in its buffer); ZeRO-1/2's updated parameters gathered per unit after the optimizer.
    With ``experts``, the calls over ``ep_replicate`` of the units' expert weights, a shard of their own in
    each unit holding a block (neither end: the per-parameter style gathers every one again for backward,
    buffer reuse all but the last two blocks', still in its two buffers).
    Empty for DDP (its buckets: :func:`parallelisms.perf.buckets.ddp_buckets`)."""
    flat = parallel.zero or parallel.fsdp or flat_mixed_precision(parallel)
    if not flat:
        return {}
    held = parallel.dims.pp > 1
    stages = _merged_stage_units(cfg, parallel, train)
    units = sum(sum(any(units[i][1] for i in g) for g in merged) if experts else len(merged) for units, merged in stages)
    shard_grads = (parallel.zero or 0) >= 2 or (parallel.fsdp is not None and parallel.fsdp.stage >= 2)
    m = _microbatches_reduced(parallel, train) if shard_grads else 1
    out = {"reduce_scatter": m * units}
    if parallel.fsdp and parallel.fsdp.hybrid or parallel.fsdp is FsdpStrategy.NO_SHARD or (
            not parallel.zero and not parallel.fsdp):
        out["all_reduce"] = m * units  # the reduced shard over the replicas (NO_SHARD: the whole gradient)
    if (parallel.zero or 0) in (1, 2) or (parallel.fsdp and parallel.fsdp.stage == 2):
        out["all_gather"] = m * units if parallel.fsdp else units
    elif sharding_stage(parallel) == 3:
        not_again = {FsdpStyle.FLAT: 0, FsdpStyle.PER_PARAM: 0 if experts else 2, FsdpStyle.REUSE: 2 if experts else 3}
        again = 0 if held else units - not_again[parallel.fsdp_style]
        out["all_gather"] = m * (units + again)
    return out


def _link_dim(parallel: ParallelConfig, v) -> str:
    """The group a data-parallel collective runs over: HSDP gathers and reduce-scatters within its shard group
    (a node's NVLink where it fits one) and all-reduces across the replicas; the others over ``v.dim``."""
    if not (parallel.fsdp and parallel.fsdp.hybrid) or parallel.dims.dp_replicate == 1 or v.dim != "dp":
        return v.dim
    return "dp_replicate" if v.kind == "all_reduce" else "dp_shard_cp"


def _gradient_shards(parallel: ParallelConfig) -> int:
    """Ranks a gradient is reduce-scattered over each microbatch (ZeRO-2/3, FSDP but NO_SHARD), else 1."""
    dims = parallel.dims
    if (parallel.zero or 0) >= 2:
        return dims.dp * dims.cp
    if parallel.fsdp is None or parallel.fsdp is FsdpStrategy.NO_SHARD:
        return 1
    if parallel.fsdp.hybrid:
        return dims.dp_shard * dims.cp
    return (dims.dp if parallel.fsdp_style is FsdpStyle.FLAT else dims.dp_shard) * dims.cp  # flat: every dp rank


def _data_parallel_exposed(traffic, cfg, lay, t_f, t_bw, hw: Hardware, pp: int = 1, units: list | None = None,
                           depth: int = 1) -> dict:
    """Exposed seconds of each data-parallel collective (see the module docstring). Without a pipeline, a fully
    sharded engine's gathers and gradient reduce-scatters run over one group, so they share its link (each
    GPU's one NIC across nodes): half the gathers (the forward's) fill the forward, the other half and the
    reduce-scatters the backward together (:func:`parallelisms.perf.prefetch.shared_link`)."""
    shared = shared_link(traffic, lay.m, t_f, t_bw, lambda t, w: behind(hw, t, w), units, depth) if pp == 1 else {}
    out = {}
    for name, role, t, calls in traffic:
        if name in shared:
            exposed = shared[name]
        elif role == "gather":  # prefetched one layer ahead over every microbatch's forward and backward
            exposed = t / (2 * cfg.n_layers) + behind(hw, t, lay.m * (t_f + t_bw))
        elif role == "reduce":  # during the last microbatch's backward, bucket by bucket
            exposed = t / calls + behind(hw, t, t_bw)
        elif role == "reduce_each":  # during every microbatch's backward, each ending with its last bucket
            exposed = lay.m * t / calls + behind(hw, t, lay.m * t_bw)
        elif role == "overlapped_update":  # under the next step's first forward, bucket by bucket
            exposed = t / calls + behind(hw, t, t_f)
        else:
            exposed = t
        out[name] = out.get(name, 0.0) + exposed + (cpu.overlapped_cpu(hw, role, calls) if hw.kind == "cpu" else 0.0)
    return out


def _states(cfg: ModelConfig, parallel: ParallelConfig) -> dict:
    experts = cfg.mlp_matrices * cfg.dim * cfg.ffn_dim * cfg.n_experts * cfg.n_layers
    return model_state_bytes(cfg.num_params(), parallel, experts)


def _optimizer_tensors(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> int:
    """Parameter tensors the optimizer of the busiest rank steps. Per parameter without a flat engine: per block
    two norms, four attention projections and the MLP's matrices (or router and experts), and the ends the rank
    holds (the embedding; the final norm and the output layer: both on one stage or the first rank of a V-shaped
    schedule, the head on the last stage otherwise). Under ZeRO, flat FSDP and bf16 data parallelism, one flat
    shard per wrapped unit of each stage (:func:`module_units`: the embedding, each block, the head), ZeRO-1/2's
    merged while they fit under ``--bucket-mb``, a unit's expert weights a shard of their own."""
    dims, layers = parallel.dims, math.ceil(cfg.n_layers / parallel.dims.pp)
    flat = parallel.zero or (parallel.fsdp and parallel.fsdp_style is FsdpStyle.FLAT) or (
        not parallel.fsdp and parallel.mixed_precision is Precision.BF16)
    if not flat:
        per_block = 6 + (1 + cfg.mlp_matrices * cfg.n_experts if cfg.n_experts else cfg.mlp_matrices)
        head = rank0_holds_head(parallel)  # a tied head on the embedding's rank is stepped as the embedding
        return per_block * layers + 2 + (head and not cfg.tie_embeddings)
    count = 0
    for units, merged in _merged_stage_units(cfg, parallel, train):
        experts = sum(any(units[i][1] for i in g) for g in merged) if dims.ep > 1 and cfg.n_experts else 0
        count += len(merged) + experts  # a merged unit holding a block: its expert weights a shard of their own
    return count


def _stage_units(cfg: ModelConfig, parallel: ParallelConfig) -> list[list[tuple[float, bool]]]:
    """(fp32 bytes, holds a block) of each wrapped unit (:func:`module_units`: the embedding, each block, the
    head) on each stage of the busiest rank: the one stage, a V-shaped schedule's first rank's two (chunk 0 with
    the embedding, the last chunk with the head), else the last stage."""
    dims, layers = parallel.dims, math.ceil(cfg.n_layers / parallel.dims.pp)
    table = vocab_rows(cfg, dims.tp) * cfg.dim
    block, embedding, head = (4 * block_params(cfg, dims.tp), True), (4 * table, False), (4 * (table + cfg.dim), False)
    if dims.pp == 1:
        return [[embedding] + [block] * layers + [head]]
    if rank0_holds_head(parallel):
        return [[embedding] + [block] * (layers // 2), [block] * (layers - layers // 2) + [head]]
    return [[block] * layers + [head]]


def _merged_stage_units(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> list[tuple[list, list]]:
    """Each stage's units (:func:`_stage_units`) with the indices of each unit the engine communicates, merged
    as the runtime merges them (parallel/wrap.py; ZeRO-1/2 under ``--bucket-mb``, parallel/zero.py)."""
    cap = train.bucket_mb * 2**20 if parallel.zero in (1, 2) else 0.0
    return [(units, merged_units([size for size, _ in units], cap, [False] * len(units)))
            for units in _stage_units(cfg, parallel)]


def _optimizer_time(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hw: Hardware,
                    kernels: str = "fused") -> float:
    """Adam over this rank's optimizer shard, memory-bound: a fused step reads and writes the fp32 master,
    gradient and two moments once (36 bytes per parameter), the eager multi-tensor step on a GPU moves
    FOREACH_ADAMW_BYTES; at the optimizer's rate (``hw.optimizer_bytes_per_s``: a CPU's measured against the
    nominal 36 bytes), plus the host time per parameter tensor of a per-tensor step (``hw.optimizer_tensor_us``;
    0 for fused ones); PipeDream steps once per microbatch."""
    states = _states(cfg, parallel)
    if not states["optimizer"]:
        return 0.0
    per_param = FOREACH_ADAMW_BYTES if kernels == "eager" and hw.kind != "cpu" else FUSED_ADAMW_BYTES
    return pipedream_updates(parallel) * (states["optimizer"] / 8 * per_param / hw.optimizer_bytes_per_s
                                          + _optimizer_tensors(cfg, parallel, train) * hw.optimizer_tensor_us * 1e-6)


def memory_per_rank(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, hw: Hardware, lay: Layout,
                    in_flight: float, attention: str = "flash") -> dict:
    """Bytes of the busiest rank at its peak, by kind, as this runtime holds them (perf/memory.py, which the dry
    run checks: ``estimate --check``); flash attention keeps no scores (Table 2's 5as/h term drops)."""
    from parallelisms.perf.memory import rank_memory

    return rank_memory(cfg, parallel, train, attention)
