"""Compute time of one transformer layer per pass, from its GEMM shapes and the bytes its elementwise kernels
move; nothing is fitted to a step time.

* FLOPs per layer per pass: each linear layer is one GEMM forward, two backward (input gradient, weight
  gradient: Narayanan et al. SC'21, Sec. 5.1); attention's QK^T and AV are batched GEMMs; recomputation
  repeats the forward of the block (full) or of the attention core (selective, Korthikanti et al. MLSys'23).
* GEMM time: the roofline (Williams et al. 2009) on the GEMM's arithmetic intensity, with an efficiency that
  depends on its shape: a short reduction dimension k (prologue/epilogue cost: k / (k + k_half)), tile
  quantisation and wave quantisation over the streaming multiprocessors (NVIDIA's "Matrix multiplication
  background" guide). Tensor parallelism slices n or k by t, which is where tp-sliced GEMMs lose efficiency.
* Elementwise kernels (norms, residual adds, activation, softmax, dropout) are memory-bound: bytes read and
  written over the HBM bandwidth; backward moves about twice the forward's bytes. On a GPU they are the fused
  kernels of the published runs (Megatron-LM); on a CPU (``hw.kind``) they are this project's eager
  operators, each reading and writing its own tensors (:func:`eager_elementwise_bytes`, about three times
  the fused count).
* Attention: ``flash`` (fused, causal half of the scores, nothing materialised; Dao et al. 2022) or
  ``fused-softmax`` (Megatron-LM 2021-22: scores materialised, one scale/mask/softmax kernel, then dropout),
  at ``hw.attention_fraction`` of a GEMM's efficiency (measured by ``calibrate`` on a CPU, whose attention
  kernel reaches about a third of its GEMM rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallelisms.config import ModelConfig
from parallelisms.perf import cpu
from parallelisms.perf.hardware import ATTENTION_KERNELS, KERNELS, Hardware  # noqa: F401 -- the kernels' names
from parallelisms.perf.model import vocab_rows

# Bytes per parameter torch.optim.AdamW's multi-tensor (foreach) step moves, its default on a GPU: decay
# (read, write the fp32 weight), the first moment's lerp (read two, write one), the second's scale and addcmul,
# the denominator's sqrt, division and epsilon, and addcdiv into the weight; counted with TorchDispatchMode
# (tests/test_perf_eager.py). A fused Adam reads and writes each of its four fp32 tensors once: 36.
FOREACH_ADAMW_BYTES = 80
FUSED_ADAMW_BYTES = 36
# Bytes per logit element of the eager fp32 cross-entropy on 16-bit logits (model/transformer.py's
# CrossEntropy): forward the upcast (read 2, write 4) and log-softmax (read, write 4); backward the loss
# gradient written (4), log-softmax's backward (read two, write one: 12) and the cast back (read 4, write 2).
EAGER_LOSS_BYTES = (14, 22)
FUSED_LOSS_BYTES = (3 * 4, 3 * 4)  # a fused cross-entropy reads and writes the fp32 logits about three times
# Operators one block dispatches (forward, backward), counted with TorchDispatchMode on model/transformer.py's
# Block; the embedding, final norm, head and loss add HEAD_OPS. Each costs the host ``op_overhead_us``, hidden
# behind a GPU's kernels unless they are shorter (launch-bound models; on a CPU: perf.cpu.dispatched). A CPU's
# tensor parallelism adds this runtime's comm-layer operators, an MoE block its routing's (perf.cpu.block_ops).
BLOCK_OPS = {"swiglu": (92, 148), "gelu": (87, 136)}
HEAD_OPS = (21, 34)
# On a GPU the collectives are NCCL calls on device buffers, Megatron-LM's f and g (Shoeybi et al. 2019): tensor
# parallelism adds only its collective calls per block (forward, backward; with SP the backward's re-gathers and
# the norms' gradient all-reduces), and at the ends the vocabulary-parallel loss's two all-reduces and the
# embedding's and head input's collective.
GPU_TP_BLOCK_OPS = {"tp": (2, 2), "sp": (4, 8)}
GPU_TP_MOE_BLOCK_OPS = {"tp": (1, 1), "sp": (3, 6)}  # attention's; an MoE layer's SP gathers (parallel/moe_sequence.py)
GPU_TP_HEAD_OPS = {"tp": (4, 2), "sp": (5, 4)}


def block_ops(mlp: str, tp: int = 1, sp: bool = False, device: bool = False, moe: bool = False) -> tuple[int, int]:
    """Operators one block dispatches forward and backward (BLOCK_OPS, with tensor parallelism's: this runtime's
    on a CPU, an ``moe`` block's routing too, perf.cpu.block_ops; the collective calls alone on a ``device``, an
    ``moe`` block's fewer)."""
    if not device:
        return cpu.block_ops(BLOCK_OPS[mlp], tp, sp, moe)
    forward, backward = BLOCK_OPS[mlp]
    if tp == 1:
        return forward, backward
    extra = (GPU_TP_MOE_BLOCK_OPS if moe else GPU_TP_BLOCK_OPS)["sp" if sp else "tp"]
    return forward + extra[0], backward + extra[1]


def head_ops(tp: int = 1, sp: bool = False, device: bool = False) -> tuple[int, int]:
    """Operators the embedding, final norm, head and loss dispatch forward and backward."""
    if tp == 1:
        return HEAD_OPS
    if device:
        extra = GPU_TP_HEAD_OPS["sp" if sp else "tp"]
        return HEAD_OPS[0] + extra[0], HEAD_OPS[1] + extra[1]
    return cpu.TP_HEAD_OPS["sp" if sp else "tp"]


def with_dispatch(hw: Hardware, seconds: float, ops: int) -> float:
    """A pass of ``seconds`` of work that dispatches ``ops`` operators: the device runs ahead of the host while
    its kernels are longer (a CPU: perf.cpu.dispatched)."""
    if hw.kind == "cpu":
        return cpu.dispatched(hw, seconds, ops)
    return max(seconds, ops * hw.op_overhead_us * 1e-6)


def gemm_efficiency(hw: Hardware, m: float, n: float, k: float, batch: float = 1) -> float:
    """Share of peak a GEMM [m, k] x [k, n] (``batch`` of them) reaches before the memory roofline."""
    eff = hw.gemm_fraction * k / (k + hw.gemm_k_half)
    if hw.tile:
        tiles_m, tiles_n = math.ceil(m / hw.tile), math.ceil(n / hw.tile)
        eff *= m * n / (tiles_m * tiles_n * hw.tile**2)
        if hw.sms:
            tiles = tiles_m * tiles_n * batch
            eff *= tiles / (math.ceil(tiles / hw.sms) * hw.sms)
    return eff


def gemm_time(hw: Hardware, m: float, n: float, k: float, batch: float = 1, cold: float = 0.0) -> float:
    """Seconds for ``batch`` GEMMs [m, k] x [k, n]: compute at the shape's efficiency, or memory if slower; on a
    CPU a core also waits for its ``cold`` operand elements (perf.cpu.cold_load)."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    flops = 2 * m * n * k * batch
    traffic = (m * k + k * n + m * n) * batch * hw.bytes_per_element
    load = cpu.cold_load(hw, cold, batch) if hw.kind == "cpu" else 0.0
    return max(flops / (hw.gemm_peak_flops * gemm_efficiency(hw, m, n, k, batch)) + load, traffic / hw.memory_bytes_per_s)


def causal_attention_gemms(hw: Hardware, heads: float, s_q: float, s_kv: float, d: float) -> float:
    """Seconds of causal attention's QK^T and AV at GEMM efficiency over ``heads`` (batch x heads) problems,
    half the score blocks computed (flash); the attention kernel reaches ``hw.attention_fraction`` of it."""
    return (gemm_time(hw, s_q, s_kv, d, heads) + gemm_time(hw, s_q, d, s_kv, heads)) / 2


@dataclass(frozen=True)
class LayerShape:
    """One rank's share of one layer for one microbatch: ``tokens`` = b x s/cp rows, tp/sp/ep sharding."""
    cfg: ModelConfig
    batch: int          # sequences per microbatch
    seq: int            # full sequence length
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    attention: str = "flash"
    fp8: bool = False   # the linear layers' GEMMs in FP8 (Transformer Engine's recipe)
    kernels: str = "eager"  # the non-GEMM work on a GPU: KERNELS
    chunks: int = 1     # pieces each forward tp GEMM and its collective run in (--tp-overlap-chunks)

    @property
    def tokens(self) -> float:
        return self.batch * self.seq / self.cp

    @property
    def linear_params(self) -> float:
        """Parameters of the layer's linear layers on one rank."""
        return sum(n * k * b for _, n, k, b in _linears(self))


@dataclass(frozen=True)
class PassTimes:
    """Seconds per layer per microbatch: forward, input gradient, weight gradient, and the forward of the
    attention core alone (what selective recomputation repeats); FLOPs of the forward; the input- and
    weight-gradient GEMMs of the two column-parallel layers (QKV, MLP in), which tp collectives overlap."""
    forward: float
    input_grad: float
    weight_grad: float
    attention_core: float
    forward_flops: float
    column_input_grads: tuple = (0.0, 0.0)
    column_weight_grads: tuple = (0.0, 0.0)


def _linears(shape: LayerShape) -> list[tuple[float, float, float, float]]:
    """(m, n, k, batch) of each linear layer's forward GEMM on one rank: QKV, output projection, (router,)
    MLP in, MLP out."""
    cfg, t, T = shape.cfg, shape.tp, shape.tokens
    kv = cfg.n_kv_heads * cfg.head_dim
    out = [(T, (cfg.q_dim + 2 * kv) / t, cfg.dim, 1), (T, cfg.dim, cfg.q_dim / t, 1)]
    if cfg.n_experts:  # uniform routing: each local expert gets tokens x top_k / experts x ep rows; experts
        local = cfg.n_experts / shape.ep  # replicate over tp, and each tp rank routes the tp-gathered tokens
        rows = T * cfg.top_k / cfg.n_experts * shape.ep
        out += [(T, cfg.n_experts, cfg.dim, 1), (rows, 2 * cfg.ffn_dim, cfg.dim, local),
                (rows, cfg.dim, cfg.ffn_dim, local)]
    else:
        out += [(T, (cfg.mlp_matrices - 1) * cfg.ffn_dim / t, cfg.dim, 1), (T, cfg.dim, cfg.ffn_dim / t, 1)]
    return out


def _attention_core(hw: Hardware, shape: LayerShape) -> tuple[float, float, float]:
    """(forward seconds, backward seconds, forward FLOPs) of QK^T, softmax, (dropout) and AV."""
    cfg = shape.cfg
    heads = shape.batch * cfg.n_heads / shape.tp
    s_q, s_kv, d = shape.seq / shape.cp, shape.seq, cfg.head_dim
    flops = 4 * heads * s_q * s_kv * d
    if shape.attention == "flash":  # causal: half the score blocks computed; nothing materialised
        fwd = causal_attention_gemms(hw, heads, s_q, s_kv, d) / hw.attention_fraction
        return fwd, hw.attention_backward * fwd, flops
    scores = heads * s_q * s_kv
    e = hw.bytes_per_element
    fwd = 2 * causal_attention_gemms(hw, heads, s_q, s_kv, d) / hw.attention_fraction  # every score block
    fwd_elementwise = scores * (2 * e + 2 * e + 1) / hw.memory_bytes_per_s   # softmax r/w; dropout r/w + mask
    return fwd + fwd_elementwise, 2 * fwd + 2 * fwd_elementwise, flops


def _elementwise_bytes(shape: LayerShape) -> float:
    """Bytes the forward's memory-bound kernels move: two norms (read, write), two residual adds with dropout
    (read two, write one, a mask byte), the activation (GELU read, write; SwiGLU read two, write one)."""
    cfg, T, e = shape.cfg, shape.tokens, 2
    residual = T * cfg.dim / (shape.tp if shape.sp else 1)
    width = cfg.ffn_dim * cfg.top_k if cfg.n_experts else cfg.ffn_dim / shape.tp
    activation = (2 if cfg.mlp == "gelu" else 3) * T * width * e
    return 2 * 2 * residual * e + 2 * (3 * e + 1) * residual + activation


def eager_elementwise_bytes(shape: LayerShape, e: int, wide: int = 4) -> float:
    """Bytes the forward's eager operators (model/transformer.py's Block) read and write, per rank, in elements
    of ``e`` bytes with the norms and rotary computed in ``wide`` (fp32) ones: with D the residual width (over tp
    rows under SP), Q and K the rank's query and key/value widths and F its MLP width, per token two RMSNorms
    (pow, mean, scale, weight: 7D wide elements each, and below fp32 the upcast and the cast back), two residual
    adds (3D each), rotary on q and k (four products, a difference, a sum and the stack: 9 wide widths each,
    and the casts), grouped key/value heads repeated to the query heads (2(K + Q)), the attention output laid
    back (2Q) and the activation (SwiGLU's silu and product 5F, GELU 2F). Within 3% of what TorchDispatchMode
    counts on the Block in fp32 and in bf16 (tests/test_perf_eager.py)."""
    cfg, t = shape.cfg, shape.tp
    residual = cfg.dim / (t if shape.sp else 1)
    q, kv = cfg.n_heads * cfg.head_dim / t, cfg.n_kv_heads * cfg.head_dim / t
    width = cfg.ffn_dim * cfg.top_k if cfg.n_experts else cfg.ffn_dim / t
    repeated = 2 * (q + kv) if kv < q else 0
    casts = 2 * (e + wide) if e < wide else 0  # up to fp32 and back, per element
    norms = 2 * (residual * (5 * wide + 2 * e + casts))
    rotary = (q + kv) * (9 * wide + casts)
    narrow = 6 * residual + 2 * q + repeated + (5 if cfg.mlp == "swiglu" else 2) * width
    return shape.tokens * (norms + rotary + narrow * e)


def sequence_parallel_copies(shape: LayerShape, e: int) -> tuple[float, float]:
    """(forward, backward) bytes this runtime's sequence parallelism copies per block beyond the operators'
    own: a gather or reduce-scatter along the sequence goes through the comm layer's dim-0 buffer, and the
    full activation is laid back along the sequence by a concatenation (read and written once). Forward: the
    two gathers and two reduce-scatters; backward: two (the others reuse the forward's). Counted with
    TorchDispatchMode on a tp 2 block (comm/ops.py; Megatron-LM's kernels gather in place on GPUs). In
    ``shape.chunks`` pieces (``--tp-overlap-chunks``) a dense region's forward concatenates nothing
    (parallel/tensor.py's chunked gather and reduce-scatter): a column GEMM's input pieces are copied out of the
    transposed sequence shard (already contiguous for one sequence) and its output pieces laid back into place, a
    row GEMM's input pieces copied out of their rank-major blocks, each element once whatever the count (an MoE
    layer is never chunked)."""
    if shape.tp == 1 or not shape.sp:
        return 0.0, 0.0
    activation = 2 * shape.tokens * shape.cfg.dim * e  # read and written
    if shape.chunks <= 1:
        return 4 * activation, 2 * activation
    linears = _linears(shape)
    regions = [linears[:2]] + ([] if shape.cfg.n_experts else [linears[-2:]])
    inputs = shape.batch > 1
    pieces = sum(inputs * m * k / shape.tp + m * n + row_m * row_k for (m, n, k, _), (row_m, _, row_k, _) in regions)
    return 2 * pieces * e + (4 - 2 * len(regions)) * activation, 2 * activation


def layer_gemms(shape: LayerShape) -> tuple[list, list, list]:
    """The forward, input-gradient and weight-gradient GEMMs of one layer on one rank, each (m, n, k, batch,
    cold elements): the cold operand is the weight in the forward and the input gradient, the input saved since
    the forward in the weight gradient."""
    linears = _linears(shape)
    return ([(m, n, k, b, n * k) for m, n, k, b in linears], [(m, k, n, b, n * k) for m, n, k, b in linears],
            [(k, n, m, b, m * k) for m, n, k, b in linears])


def fp8_cast_bytes(shape: LayerShape) -> tuple[float, float]:
    """(forward, backward) bytes FP8 training's casts move per layer (Transformer Engine, Micikevicius et al.
    2022, "FP8 Formats for Deep Learning"): each linear layer's input is read in 16 bits and written in 8 with
    its scale (3 bytes per element) forward; backward casts its output gradient and writes the transposes the
    weight gradient's FP8 GEMM reads (the input's and the gradient's: 3 bytes per element each). The weights'
    casts, once per step, are left out. Attention, norms and the optimizer stay in 16 bits."""
    forward = backward = 0.0
    for m, n, k, b in _linears(shape):
        forward += 3 * m * k * b
        backward += 3 * (2 * m * n + m * k) * b
    return forward, backward


def layer_times(hw: Hardware, shape: LayerShape) -> PassTimes:
    """Seconds of one layer on one rank for one microbatch (compute only; collectives are in step.py)."""
    forwards, input_grads, weight_grads = layer_gemms(shape)
    linear_hw = hw.fp8() if shape.fp8 else hw
    fwd = sum(gemm_time(linear_hw, *g) for g in forwards)
    flops = sum(2 * m * n * k * b for m, n, k, b, _ in forwards)
    dgrads, wgrads = [gemm_time(linear_hw, *g) for g in input_grads], [gemm_time(linear_hw, *g) for g in weight_grads]
    dgrad, wgrad = sum(dgrads), sum(wgrads)
    core_f, core_b, core_flops = _attention_core(hw, shape)
    if hw.kind == "cpu" or shape.kernels == "eager":  # this runtime's eager operators
        copies = sequence_parallel_copies(shape, hw.bytes_per_element)
        moved = eager_elementwise_bytes(shape, hw.bytes_per_element)
    else:  # the fused kernels of Megatron-LM's runs
        copies, moved = (0.0, 0.0), _elementwise_bytes(shape) * hw.bytes_per_element / 2
    casts = fp8_cast_bytes(shape) if shape.fp8 else (0.0, 0.0)
    elementwise = [(passes * moved + copied + cast) / hw.memory_bytes_per_s
                   for passes, copied, cast in zip((1, 2), copies, casts)]
    column = (0, len(forwards) - 2)  # QKV and the MLP's input projection
    ops_f, ops_b = block_ops(shape.cfg.mlp, shape.tp, shape.sp, device=hw.kind != "cpu", moe=bool(shape.cfg.n_experts))
    return PassTimes(with_dispatch(hw, fwd + core_f + elementwise[0], ops_f),
                     with_dispatch(hw, dgrad + core_b + elementwise[1], ops_b), wgrad, core_f,
                     flops + core_flops, tuple(dgrads[i] for i in column), tuple(wgrads[i] for i in column))


def head_gemms(cfg: ModelConfig, tokens: float, tp: int) -> tuple[tuple, tuple, tuple]:
    """The output projection's forward, input-gradient and weight-gradient GEMMs, as :func:`layer_gemms`."""
    v = vocab_rows(cfg, tp)
    return (tokens, v, cfg.dim, 1, v * cfg.dim), (tokens, cfg.dim, v, 1, v * cfg.dim), (cfg.dim, v, tokens, 1, tokens * cfg.dim)


def head_times(hw: Hardware, cfg: ModelConfig, tokens: float, tp: int, sp: bool = False,
               kernels: str = "fused") -> PassTimes:
    """The output projection and the fp32 cross-entropy over the (vocabulary-parallel) logits: a fused kernel
    (and the CPU's, as calibrated) reads and writes the fp32 logits about three times each pass; a GPU's eager
    operators move :data:`EAGER_LOSS_BYTES` per logit."""
    v = vocab_rows(cfg, tp)
    forward, input_grad, weight_grad = (gemm_time(hw, *g) for g in head_gemms(cfg, tokens, tp))
    per_logit = cpu.LOSS_BYTES if hw.kind == "cpu" else EAGER_LOSS_BYTES if kernels == "eager" else FUSED_LOSS_BYTES
    loss_f, loss_b = (tokens * v * b / hw.memory_bytes_per_s for b in per_logit)
    ops_f, ops_b = head_ops(tp, sp, device=hw.kind != "cpu")
    return PassTimes(with_dispatch(hw, forward + loss_f, ops_f), with_dispatch(hw, input_grad + loss_b, ops_b),
                     weight_grad, 0.0, 2 * tokens * v * cfg.dim)
