"""What compute hides of a collective (spec: "Critical path and latency hiding"), and the tensor-parallel
collectives priced with it where the runtime (parallel/tensor.py) puts them:

* :func:`behind`: an asynchronous collective waited for after a window of independent compute;
* :func:`chunked_overlap`: a GEMM and the collective that produces its input rows or consumes its output rows,
  decomposed into C chunks that pipeline (Wang et al. ASPLOS'23, "Overlap communication with dependent
  computation via decomposition"; Transformer Engine's comm overlap; PyTorch's async TP);
* :func:`tensor_parallel_comm` (a block) and :func:`head_comm` (the vocabulary-parallel ends), per microbatch.

Per sublayer (attention, MLP), Megatron's f (the column-parallel region's input) and g (the row-parallel
output; Shoeybi et al. 2019). Without sequence parallelism g all-reduces forward (``--tp-overlap-chunks C``:
pipelined with the row-parallel GEMM over C row blocks) and f backward (``--tp-overlap``: behind the
weight-gradient GEMM). With it (Korthikanti et al. 2023) f all-gathers the sequence forward and g
reduce-scatters it (with C chunks each pipelined with its GEMM: the column GEMM consumes the gather piece by
piece, the row GEMM's output is reduce-scattered piece by piece); backward, g's all-gather of the output
gradient is exposed, f's re-gather of the saved sequence shard runs behind the input-gradient GEMMs (the
runtime always launches it before them) and f's reduce-scatter behind the weight gradient under
``--tp-overlap``; each norm weight's gradient is all-reduced (Sec. 4.2.2). An MoE layer's experts run whole on
every tp rank (parallel/moe_sequence.py, as Megatron-Core with expert TP 1): without SP it holds no tp
collective, with SP one all-gather each way (its input forward, its output's gradient backward), exposed.
"""

from __future__ import annotations

from parallelisms.perf.compute import LayerShape, PassTimes, gemm_time, head_gemms, layer_gemms
from parallelisms.perf.hardware import Hardware
from parallelisms.perf.network import comm_time


def behind(hw: Hardware, t: float, window: float) -> float:
    """Exposed seconds of a collective of ``t`` overlapped with ``window`` seconds of compute: what outlasts
    the window, and the share of the rest that is the rank's own CPU work (``hw.comm_cpu_fraction``: a CPU
    comm layer copies on the core the compute needs)."""
    return max(0.0, t - window) + hw.comm_cpu_fraction * min(t, window)


def chunked_overlap(hw: Hardware, gemm: tuple, whole: float, chunk: float, chunks: int) -> float:
    """Exposed seconds of a forward GEMM (m, n, k, batch, cold) pipelined over ``chunks`` pieces of its m rows
    with a collective of ``chunk`` seconds per piece (an all-reduce or reduce-scatter of piece i's output under
    piece i+1's GEMM, or an all-gather of piece i+1's input under piece i's): the two-stage pipeline's span,
    g + c + (C - 1) max(g, c), less the unchunked GEMM, so the chunking's cost (C smaller GEMMs, C latencies)
    is charged; ``whole`` (the unchunked collective, all exposed) for one chunk."""
    m, n, k, b, cold = gemm
    if chunks <= 1:
        return whole
    g = gemm_time(hw, m / chunks, n, k, b, cold / chunks if cold == m * k else cold)
    span = g + chunk + (chunks - 1) * max(g, chunk)
    return max(0.0, span - gemm_time(hw, m, n, k, b, cold)) + hw.comm_cpu_fraction * (chunks - 1) * min(g, chunk)


def _pipelined(hw: Hardware, parallel, kind: str, nbytes: float, gemm: tuple, gemm_hw: Hardware) -> float:
    """Exposed seconds of the forward collective ``kind`` of ``nbytes`` over tp beside ``gemm``: whole, or
    under ``--tp-overlap-chunks`` C pipelined with it (:func:`chunked_overlap`)."""
    chunks = parallel.tp_overlap_chunks if parallel.tp_overlap else 0
    whole = comm_time(hw, parallel, kind, "tp", nbytes)
    if chunks <= 1:
        return whole
    return chunked_overlap(gemm_hw, gemm, whole, comm_time(hw, parallel, kind, "tp", nbytes / chunks), chunks)


def tensor_parallel_comm(cfg, parallel, hw: Hardware, shape: LayerShape, times: PassTimes) -> tuple[float, float]:
    """(forward, backward) exposed seconds of a block's tp collectives per microbatch (see the module docstring)."""
    activation = shape.tokens * cfg.dim * hw.bytes_per_element
    linears, gemm_hw = layer_gemms(shape)[0], hw.fp8() if shape.fp8 else hw
    regions = [(linears[0], linears[1])] + ([] if cfg.n_experts else [(linears[-2], linears[-1])])
    sublayers = zip(regions, times.column_input_grads, times.column_weight_grads)  # (column, row): QKV/out, MLP in/out
    forward = backward = 0.0
    if cfg.n_experts and parallel.sequence_parallel:  # the MoE layer: its input gathered, its output's gradient too
        forward = backward = comm_time(hw, parallel, "all_gather", "tp", activation)
    for (column, row), dgrad, wgrad in sublayers:
        hide = wgrad if parallel.tp_overlap else 0.0  # f's backward collective behind the weight gradient
        if parallel.sequence_parallel:
            gather = comm_time(hw, parallel, "all_gather", "tp", activation)
            scatter = comm_time(hw, parallel, "reduce_scatter", "tp", activation)
            forward += (_pipelined(hw, parallel, "all_gather", activation, column, gemm_hw)
                        + _pipelined(hw, parallel, "reduce_scatter", activation, row, gemm_hw))
            backward += gather + behind(hw, gather, dgrad) + behind(hw, scatter, hide)
        else:
            forward += _pipelined(hw, parallel, "all_reduce", activation, row, gemm_hw)
            backward += behind(hw, comm_time(hw, parallel, "all_reduce", "tp", activation), hide)
    if parallel.sequence_parallel:  # the norms' weights see 1/t of the tokens: their gradients are summed
        backward += 2 * comm_time(hw, parallel, "all_reduce", "tp", cfg.dim * hw.bytes_per_element)  # (blocking)
    return forward, backward


def head_comm(cfg, parallel, hw: Hardware, shape: LayerShape) -> tuple[float, float]:
    """(forward, backward) seconds of the ends' tp collectives per microbatch: the vocabulary-parallel
    cross-entropy's two all-reduces (row maxima; sums of exponentials and target logits: Megatron-LM's), the
    output layer's f as a block's column region has it (its input gradient all-reduced, behind the head's
    weight gradient under ``--tp-overlap``; under SP the final norm's output gathered, pipelined with the head
    GEMM under ``--tp-overlap-chunks``, re-gathered behind the input-gradient GEMM and its gradient
    reduce-scattered) and, under SP, the final norm weight's gradient all-reduced; on a single stage also the
    vocabulary-parallel embedding's (its output all-reduced; under SP reduce-scattered, and its gradient
    all-gathered). The rest of a pipeline's first stage is lighter than the last's."""
    if parallel.dims.tp == 1:
        return 0.0, 0.0
    activation, embedding = shape.tokens * cfg.dim * hw.bytes_per_element, parallel.dims.pp == 1
    forward = sum(comm_time(hw, parallel, "all_reduce", "tp", nbytes) for nbytes in (4 * shape.tokens, 8 * shape.tokens))
    gemm, dgrad, wgrad = head_gemms(cfg, shape.tokens, parallel.dims.tp)
    hide = gemm_time(hw, *wgrad) if parallel.tp_overlap else 0.0
    if not parallel.sequence_parallel:
        reduce = comm_time(hw, parallel, "all_reduce", "tp", activation)
        return forward + embedding * reduce, behind(hw, reduce, hide)
    gather = comm_time(hw, parallel, "all_gather", "tp", activation)
    scatter = comm_time(hw, parallel, "reduce_scatter", "tp", activation)
    norm = comm_time(hw, parallel, "all_reduce", "tp", cfg.dim * hw.bytes_per_element)
    return (forward + _pipelined(hw, parallel, "all_gather", activation, gemm, hw) + embedding * scatter,
            behind(hw, gather, gemm_time(hw, *dgrad)) + behind(hw, scatter, hide) + norm + embedding * gather)
