"""The CPU hardware adapter: the step model's mechanisms that exist because this runtime's ranks run on CPU cores
(hardware with ``cores``, ``Hardware.kind == "cpu"``: the ``cpu`` preset, a ``parallelisms calibrate`` file), each
measured on this machine and checked in tests/test_perf_cpu_mechanisms.py. perf/compute.py and perf/step.py call
them where the hardware kind is ``cpu``; a GPU's step reads without them.

* Operators (:func:`dispatched`): the host dispatches each operator and then runs it on the same core, so its
  dispatch adds to its work (a GPU runs ahead of the host: the longer of the two). Tensor parallelism adds the
  comm layer's and the sharded modules' own operators, an MoE block its routing's (:func:`block_ops`,
  :data:`TP_HEAD_OPS`).
* Cold operands (:func:`cold_load`): a GEMM's weight, evicted since its last pass, comes from memory first.
* The loss (:data:`LOSS_BYTES`): the fp32 logits read and written about three times each pass (calibrated).
* Gradients (:func:`accumulation_time`, :func:`gradient_copies_time`): autograd adds each later microbatch's
  weight gradients into the held ones, and the data-parallel engines copy gradients into their buffers, on
  the rank's core (a GPU's weight-gradient GEMM accumulates in place and writes the reduction buffer).
* Collectives (:func:`overlapped_cpu`): an asynchronous call's comm worker thread shares the rank's core.
* Ranks outnumbering the cores (:func:`cores_step`): the cores run whichever rank is ready, so the step is one
  rank's CPU work times the ranks per core, each blocking collective costing ``meeting_overhead_us``
  (:func:`meetings`).
"""

from __future__ import annotations

from parallelisms.config import ModelConfig, ParallelConfig
from parallelisms.options import FsdpStyle, Recompute
from parallelisms.perf.context import context_calls
from parallelisms.perf.hardware import Hardware
from parallelisms.perf.model import grad_norm_volumes, rank0_params, vocab_rows

# Tensor parallelism's operators beyond a block's own (output buffers, contiguous copies, views; under SP the
# sequence shards' and the norms' gradient reductions) and the ends' instead of theirs (the loss's maxima through
# shared memory): counted with TorchDispatchMode at tp 2 on `small` (SwiGLU; GELU within 3), one sequence of 128
# tokens, on a dense block.
TP_BLOCK_OPS = {"tp": (38, 28), "sp": (62, 98)}
TP_HEAD_OPS = {"tp": (109, 51), "sp": (120, 86)}
# An MoE block's operators beyond a dense one's (model/moe.py: the router's top-k, softmaxes and auxiliary loss,
# the capacity's running count, the sort, counts and scatter into the grouped GEMM's padded batch and the
# weighted gather back; as many whatever the experts), and tensor parallelism's beyond those (the attention's
# comm-layer operators; under SP also the MoE layer's all-gather of its input and its output's split,
# parallel/moe_sequence.py): counted the same way on `small` with 8 experts of top 2, backward with the
# auxiliary loss's gradient.
MOE_BLOCK_OPS = (50, 31)
TP_MOE_BLOCK_OPS = {"tp": (19, 12), "sp": (48, 84)}
LOSS_BYTES = (3 * 4, 3 * 4)  # per logit, forward and backward


def block_ops(dense: tuple[int, int], tp: int, sp: bool, moe: bool) -> tuple[int, int]:
    """Operators one block of this runtime dispatches on a CPU, forward and backward: a dense block's
    (``dense``), an MoE block's beyond them, and tensor parallelism's for the block's kind."""
    forward, backward = dense
    extras = [MOE_BLOCK_OPS] if moe else []
    if tp > 1:
        extras.append((TP_MOE_BLOCK_OPS if moe else TP_BLOCK_OPS)["sp" if sp else "tp"])
    return forward + sum(f for f, _ in extras), backward + sum(b for _, b in extras)


def dispatched(hw: Hardware, seconds: float, ops: int) -> float:
    """A pass of ``seconds`` of work that dispatches ``ops`` operators on the core that runs them."""
    return seconds + ops * hw.op_overhead_us * 1e-6


def cold_load(hw: Hardware, cold: float, batch: float) -> float:
    """Seconds a core waits for ``cold`` elements of a GEMM's operands (``batch`` GEMMs) to come from memory
    rather than cache (a weight is read once per pass, evicted by the rest of the pass since): measured here, a
    layer's GEMMs at 128 rows ran at 127 GFLOP/s on cached operands and 108 after the weights were evicted, the
    difference the weights' bytes at the elementwise bandwidth."""
    return cold * batch * hw.bytes_per_element / hw.memory_bytes_per_s


def accumulation_time(hw: Hardware, shape, layers: int, tables: int = 1) -> float:
    """Seconds a CPU rank spends adding one more microbatch's weight gradients into those it holds (autograd's
    AccumulateGrad: read both, write one) for ``layers`` blocks (linears and norms), the head (the final norm
    and the output layer) and ``tables - 1`` more vocabulary tables (the embedding, where the rank holds both
    ends) of a compute.LayerShape ``shape``; the first microbatch of a step only hands its gradients over."""
    cfg = shape.cfg  # a block: its linears' shards and its two norms' weights (whole on every tp rank)
    weights = (layers * (shape.linear_params + 2 * cfg.dim) + tables * vocab_rows(cfg, shape.tp) * cfg.dim + cfg.dim)
    return 3 * weights * hw.bytes_per_element / hw.memory_bytes_per_s


def gradient_copies_time(cfg: ModelConfig, parallel: ParallelConfig, m: int, hw: Hardware, shards: int) -> float:
    """CPU seconds per step the data-parallel engine spends moving gradients into its communication buffers, on
    the rank's own core during the backward (memory-bound: each pass reads and writes the gradient once):

    * DDP's buckets: each gradient copied into its bucket slot and pre-divided in one pass (as torch DDP's
      reducer does), once a step; with microbatches the bucket is divided again as it is launched; a pipeline
      stage's buffers are zeroed each step (a write), take the first microbatch's gradients by accumulation
      (read two, write one) and are divided as they are launched;
    * ZeRO and flat FSDP: every microbatch's backward concatenates a unit's gradients into its flat gradient
      (the backward of the split that made its parameters), and every reduction divides that in place first;
      ZeRO-1 then copies the reduced 1/N into its shard's gradient (a slice of the full gradient it keeps);
    * per-parameter FSDP and buffer reuse: every reduction copies the gradients into the rank-major send buffer
      and divides it.

    A reduction per microbatch where gradients are sharded over ``shards`` ranks (ZeRO-2/3, FSDP but NO_SHARD),
    else one a step."""
    dims = parallel.dims
    if dims.dp * dims.cp == 1:
        return 0.0
    reductions = m if shards > 1 else 1
    if not (parallel.zero or parallel.fsdp):
        passes = 3.0 if dims.pp > 1 else 1 + (m > 1)
    elif parallel.zero or parallel.fsdp_style is FsdpStyle.FLAT:
        passes = m + reductions + (reductions / (dims.dp * dims.cp) if parallel.zero == 1 else 0)
    else:
        passes = 2 * reductions
    return passes * 2 * rank0_params(cfg, parallel) * hw.bytes_per_element / hw.memory_bytes_per_s


def overlapped_cpu(hw: Hardware, role: str, calls: int) -> float:
    """CPU seconds the asynchronous calls of an overlapped data-parallel collective (gradient buckets, ZeRO-3 and
    FSDP gathers and reduce-scatters) cost the rank beyond blocking ones (``hw.overlap_overhead_us``: the comm
    layer's worker thread shares the rank's core with the compute it overlaps)."""
    return calls * hw.overlap_overhead_us * 1e-6 if role in ("gather", "reduce", "reduce_each", "overlapped_update") \
        else 0.0


def cores_step(cfg: ModelConfig, parallel: ParallelConfig, lay, hw: Hardware, traffic: list, p2p_s: float,
               step: tuple[float, dict, dict, float]) -> tuple[float, dict, dict, float]:
    """(step seconds, breakdown, per-microbatch stage seconds, bubble fraction): ``step`` as the critical path
    prices it, or, where ranks outnumber the cores and their CPU work takes longer, that work
    (:func:`cores_bound`) with the stages' times stretched by the ranks per core and no bubble (the cores never
    idle). ``lay``: the step's Layout (microbatches ``m``, the busiest stage's ``layers``)."""
    step_s, breakdown, stage_s, bubble = step
    sharing = hw.ranks_per_core(parallel.dims.world_size)
    if sharing <= 1:
        return step
    bound = cores_bound(breakdown, traffic, hw, p2p_s, meetings(cfg, parallel, lay, traffic), sharing)
    cores_s = bound["compute"] + sum(bound["exposed_comm"].values()) + bound["optimizer"] + bound["shared_cores"]
    if cores_s <= step_s:
        return step
    return cores_s, bound, {k: sharing * v for k, v in stage_s.items()}, 0.0


def cores_bound(breakdown: dict, traffic: list, hw: Hardware, p2p_s: float, meetings: int, sharing: float) -> dict:
    """The step's breakdown where ranks outnumber a CPU's cores: the cores run whichever rank is ready, so while
    one waits for a peer (or for the pipeline) another works, and the step is one rank's CPU work times the
    ``sharing`` ranks per core, with no bubble. The work: compute and optimizer, the CPU share
    (``hw.comm_cpu_fraction``) of every collective (the data-parallel ones whole, overlapped or not) and of the
    pipeline sends, each asynchronous data-parallel call's worker overhead (``hw.overlap_overhead_us``), and
    ``meetings`` blocking collectives at ``hw.meeting_overhead_us`` each."""
    share = sharing * hw.comm_cpu_fraction
    priced = {name for name, *_ in traffic}  # EPLB's all_reduce/ep is data-parallel traffic, added below
    comm = {name: share * v for name, v in breakdown["exposed_comm"].items()
            if name.endswith(("/tp", "/cp", "/ep")) and name not in priced}
    for name, role, seconds, calls in traffic:
        comm[name] = comm.get(name, 0.0) + share * seconds + sharing * overlapped_cpu(hw, role, calls)
    if p2p_s:
        comm["send/pp"] = share * p2p_s
    return {"compute": sharing * breakdown["compute"], "exposed_comm": comm, "bubble": 0.0,
            "optimizer": sharing * breakdown["optimizer"], "shared_cores": sharing * meetings * hw.meeting_overhead_us * 1e-6}


def meetings(cfg: ModelConfig, parallel: ParallelConfig, lay, traffic: list) -> int:
    """Collectives a rank of the busiest stage meets its peers in per step (as the ledger counts them): per
    layer and microbatch, tensor parallelism's (Megatron's f and g per sublayer both ways; with sequence
    parallelism the backward's re-gather and the norms' two all-reduces; an MoE layer's: none, or under SP an
    all-gather each way), ring attention's hops or Ulysses' all-to-alls, the experts' dispatch and combine (a
    full recompute repeats the forward's); per microbatch the vocabulary-parallel embedding's and head's (with
    the cross-entropy's two all-reduces; the last stage holds the head) and a pipeline send and receive; per
    step the data-parallel calls (``traffic``) and the gradient norm's."""
    dims, sp = parallel.dims, parallel.sequence_parallel
    forward = backward = ends = 0  # ring attention: one exchange per hop (its sends and receives together)
    if dims.tp > 1:  # --tp-overlap-chunks C: each forward GEMM's collective (SP: the head's gather too) in C calls
        chunks = max(1, parallel.tp_overlap_chunks) if parallel.tp_overlap else 1
        dense = 1 if cfg.n_experts else 2  # sublayers with Megatron's f and g (attention, a dense MLP)
        forward, backward = (2 * dense * chunks, 3 * dense + 2) if sp else (dense * chunks, dense)
        if cfg.n_experts and sp:  # the MoE layer's input gathered, and its output's gradient
            forward, backward = forward + 1, backward + 1
        ends = (5 + chunks if sp else 3) + (2 if sp else 1) * (dims.pp == 1)  # head, and the embedding on one stage
    if dims.cp > 1:
        forward, backward = (a + b for a, b in zip((forward, backward), context_calls(cfg, parallel)))
    if dims.ep > 1 and cfg.n_experts:  # forward: the counts per expert, then the tokens out and back
        forward, backward = forward + 3, backward + 2
    per_layer = forward * (2 if parallel.recompute is Recompute.FULL else 1) + backward
    per_microbatch = lay.layers * per_layer + ends + (2 if dims.pp > 1 else 0)
    norms = sum(1 for v in grad_norm_volumes(parallel) if v.dim in ("tp", "pp", "ep"))
    return lay.m * per_microbatch + sum(calls for _, _, _, calls in traffic) + norms
