"""Model and training configuration, presets, Hugging Face ``config.json`` loading, and validation.

Every check here runs before any process starts and fails with :class:`ConfigError`, whose message is
one line: the constraint that failed, the values, and what would work.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A bad input, reported as one line before any process starts."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (Llama family: RMSNorm, RoPE, GQA, SwiGLU, untied head)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # mixture of experts (n_experts 0: dense SwiGLU MLP in every block)
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 0.0       # 0: no capacity limit
    aux_loss_coef: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> "ModelConfig":
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"model {name} must be a positive integer, got {value!r}")
        require(self.dim % self.n_heads == 0,
                f"model dim {self.dim} must be divisible by n_heads {self.n_heads}; try n_heads in {_divisors(self.dim)}")
        require(self.n_heads % self.n_kv_heads == 0,
                f"n_heads {self.n_heads} must be divisible by n_kv_heads {self.n_kv_heads}; "
                f"try n_kv_heads in {_divisors(self.n_heads)}")
        require(self.head_dim % 2 == 0, f"head_dim {self.head_dim} (dim/n_heads) must be even for rotary positions")
        require(self.rope_theta > 0 and self.norm_eps > 0, "rope_theta and norm_eps must be positive")
        if self.n_experts:
            require(isinstance(self.n_experts, int) and self.n_experts >= 2,
                    f"n_experts must be 0 (dense) or at least 2, got {self.n_experts}")
            require(1 <= self.top_k <= self.n_experts,
                    f"top_k {self.top_k} must be between 1 and n_experts {self.n_experts}")
            require(self.capacity_factor >= 0, f"capacity_factor must be non-negative, got {self.capacity_factor}")
        return self

    def num_params(self) -> int:
        """Parameter count (embedding, attention, SwiGLU MLP, two norms per block, final norm, head)."""
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * (self.dim + 2 * kv) + self.dim * self.dim
        mlp = 3 * self.dim * self.ffn_dim * max(1, self.n_experts) + self.dim * self.n_experts
        return 2 * self.vocab_size * self.dim + self.n_layers * (attn + mlp + 2 * self.dim) + self.dim


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


PRESETS: dict[str, ModelConfig] = {
    # One training step of `tiny` takes a few milliseconds on one core.
    "tiny": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128),
    # A few million parameters: the size the benchmarks use.
    "small": ModelConfig(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=256),
    # Mixture of experts: 8 experts, top-2, in every block (expert parallelism needs one).
    "tiny-moe": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=128,
                            n_experts=8, top_k=2),
    "medium": ModelConfig(vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1376, max_seq_len=512),
    # Real shapes, for estimates and meta-device builds.
    "llama3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              max_seq_len=8192, rope_theta=500000.0),
}


def preset(name: str) -> ModelConfig:
    require(name in PRESETS, f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


_HF_FIELDS = {  # our name: (Hugging Face name, required)
    "vocab_size": ("vocab_size", True),
    "dim": ("hidden_size", True),
    "n_layers": ("num_hidden_layers", True),
    "n_heads": ("num_attention_heads", True),
    "ffn_dim": ("intermediate_size", True),
    "n_kv_heads": ("num_key_value_heads", False),
    "max_seq_len": ("max_position_embeddings", False),
    "rope_theta": ("rope_theta", False),
    "norm_eps": ("rms_norm_eps", False),
    "n_experts": ("num_local_experts", False),        # Mixtral
    "top_k": ("num_experts_per_tok", False),
}


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read a Llama-family Hugging Face ``config.json`` into a :class:`ModelConfig`."""
    path = Path(path)
    require(path.is_file(), f"config file {str(path)!r} does not exist; pass a Hugging Face config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON ({exc.__class__.__name__}: {exc})") from None
    require(isinstance(raw, dict), f"config file {str(path)!r} must hold a JSON object, got {type(raw).__name__}")
    missing = [hf for _, (hf, needed) in _HF_FIELDS.items() if needed and hf not in raw]
    require(not missing, f"config file {str(path)!r} lacks {', '.join(missing)}; a Llama-style config.json has them")
    values = {ours: raw[hf] for ours, (hf, _) in _HF_FIELDS.items() if hf in raw}
    values.setdefault("n_kv_heads", values["n_heads"])
    for name, value in values.items():
        kind = float if name in ("rope_theta", "norm_eps") else int
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or value == int(value))
        require(ok, f"config field {_HF_FIELDS[name][0]} must be a number, got {value!r}")
        values[name] = kind(value)
    return ModelConfig(**values).validate()


DTYPES = ("float32", "float64")  # parameter dtypes a run can train in


@dataclass(frozen=True)
class TrainConfig:
    """One training run: global batch, optimizer, steps, seeds."""

    steps: int = 20
    global_batch: int = 8          # sequences per optimizer step, over all data-parallel ranks
    seq_len: int = 64
    grad_accum: int = 1            # microbatches per step on each rank, no communication between them
    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0         # global-norm clipping; 0 disables it
    seed: int = 0
    bucket_mb: float = 25.0        # data-parallel gradient bucket cap
    timeout_s: float = 300.0       # collective timeout
    dtype: str = "float32"         # parameter dtype: float32, or float64 (verify's tight contract)

    def validate(self, model: ModelConfig, dp: int = 1) -> "TrainConfig":
        require(isinstance(self.steps, int) and self.steps >= 1, f"steps must be at least 1, got {self.steps}")
        require(self.global_batch >= 1, f"global batch must be at least 1, got {self.global_batch}")
        require(self.grad_accum >= 1, f"grad accumulation must be at least 1, got {self.grad_accum}")
        require(self.seq_len >= 2, f"sequence length must be at least 2, got {self.seq_len}")
        require(self.seq_len <= model.max_seq_len,
                f"sequence length {self.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
        per_step = dp * self.grad_accum
        require(self.global_batch % per_step == 0,
                f"global batch {self.global_batch} must be divisible by dp x grad_accum = {dp} x {self.grad_accum}; "
                f"try a global batch of {per_step * max(1, self.global_batch // per_step)}")
        require(self.lr > 0, f"learning rate must be positive, got {self.lr}")
        require(self.grad_clip >= 0, f"grad clip must be non-negative, got {self.grad_clip}")
        require(self.bucket_mb > 0, f"bucket size must be positive, got {self.bucket_mb} MB")
        require(self.timeout_s > 0, f"timeout must be positive, got {self.timeout_s} s")
        require(self.dtype in DTYPES, f"unknown --dtype {self.dtype!r}; choose {' or '.join(DTYPES)}")
        return self

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ParallelConfig:
    """The layout (``dims``) and the options of each parallelism, validated together before launch."""

    dims: "ParallelDims" = None  # type: ignore[assignment]
    find_unused_parameters: bool = False
    # tensor parallelism (issue: tensor parallel)
    sequence_parallel: bool = False
    tp_overlap: bool = False
    # sharded data parallelism (issue: ZeRO / FSDP)
    zero: int = 0                      # 0 (plain DDP), 1, 2, 3
    fsdp: str | None = None            # full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_zero2
    fsdp_style: str = "flat"           # flat, per_param, reuse
    mixed_precision: str = "fp32"      # fp32, bf16
    # pipeline parallelism (issue: pipeline)
    schedule: str = "1f1b"
    microbatches: int = 0              # 0: 2 x pp
    chunks: int = 1                    # virtual stages per rank (interleaved)
    pp_balance: str = "layers"         # cut stages by equal layer counts, or by measured per-layer time
    # context parallelism
    cp_attention: str = "ring"         # ring (ring attention, zigzag shards) or ulysses (all-to-all over heads)
    recompute: str = "none"            # activation recomputation: none, selective (attention core), full (block)

    def __post_init__(self):
        if self.dims is None:
            from parallelisms.mesh import ParallelDims
            object.__setattr__(self, "dims", ParallelDims())

    def replace(self, **changes) -> "ParallelConfig":
        return dataclasses.replace(self, **changes)

    def validate(self, model: ModelConfig, train: TrainConfig) -> "ParallelConfig":
        """Every cross-check of layout, model and training settings (one-line ConfigError on failure)."""
        dims = self.dims
        _check_pipeline(self, model, train)
        _check_expert_parallel(self, model)
        require(self.recompute in ("none", "selective", "full"),
                f"unknown --recompute {self.recompute!r}; choose none, selective or full")
        require(self.recompute == "none" or dims.pp == 1,
                f"--recompute {self.recompute} with --pp is not supported yet; drop one of them")
        _check_tensor_parallel(self, model, train)
        _check_context_parallel(self, model, train)
        _check_sharded_data_parallel(self)
        train.validate(model, dp=dims.dp)
        require(self.mixed_precision == "fp32" or train.dtype == "float32",
                f"--mixed-precision {self.mixed_precision} keeps float32 master weights; drop --dtype {train.dtype}")
        return self


def _check_pipeline(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--pp / --schedule / --microbatches / --chunks: a schedule that exists for these degrees (its own
    one-line ScheduleError), a layer per virtual stage, a global batch that splits into dp x microbatches."""
    from parallelisms.parallel.pipeline.schedules import ScheduleError, build_schedule

    dims, name = parallel.dims, parallel.schedule
    if dims.pp == 1:
        return
    require(dims.cp == 1 and dims.ep == 1 and not parallel.fsdp,
            f"--pp {dims.pp} composes with --dp, --tp (with or without --sp) and --zero 1 only so far; drop --cp/--ep/--fsdp")
    require(parallel.zero in (0, 1), f"--pp {dims.pp} with --zero {parallel.zero}: pipeline stages shard optimizer "
                                     f"state only (--zero 1, Megatron's distributed optimizer); use --zero 1")
    require(not parallel.zero or parallel.mixed_precision == "fp32",
            f"--pp {dims.pp} with --zero 1 trains in fp32 only so far, got --mixed-precision "
            f"{parallel.mixed_precision}; drop --mixed-precision")
    require(parallel.microbatches >= 0, f"--microbatches must be positive, got {parallel.microbatches}")
    require(parallel.pp_balance in ("layers", "measured"),
            f"unknown --pp-balance {parallel.pp_balance!r}; choose layers or measured")
    require(name == "interleaved" or parallel.chunks == 1,
            f"--chunks {parallel.chunks} applies to --schedule interleaved only ({name} fixes its chunks)")
    require(train.grad_accum == 1, f"--grad-accum {train.grad_accum} with --pp: the pipeline's --microbatches "
                                   f"already accumulate; use --microbatches instead")
    require(name != "pipedream" or dims.dp == 1,
            f"--schedule pipedream updates weights per microbatch and runs with --dp 1 only, got --dp {dims.dp}")
    m = parallel.microbatches or 2 * dims.pp
    try:
        schedule = build_schedule(name, dims.pp, m, parallel.chunks if name == "interleaved" else None)
    except ScheduleError as exc:
        raise ConfigError(f"--schedule {exc}") from None
    require(not parallel.zero or not (len(schedule.placement) > 1 or name == "pipedream"),
            f"--zero 1 with --schedule {name}: DualPipe keeps two copies of each stage and PipeDream updates per "
            f"microbatch, neither has one sharded optimizer step; use gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v "
            f"or dualpipev")
    require(dims.tp == 1 or not (schedule.split_backward or len(schedule.placement) > 1 or name == "pipedream"),
            f"--pp {dims.pp} with --tp {dims.tp} runs --schedule gpipe, 1f1b or interleaved; {name} (split backward, "
            f"DualPipe copies or per-stage clipping) does not handle tensor-parallel layers yet")
    require(model.n_layers >= schedule.num_stages,
            f"{model.n_layers} layers cannot fill {schedule.num_stages} pipeline stages ({name}: pp {dims.pp} x "
            f"{schedule.chunks} chunk(s)); use at least {schedule.num_stages} layers or a smaller --pp/--chunks")
    require(train.global_batch % (dims.dp * m) == 0,
            f"global batch {train.global_batch} must split into dp x microbatches = {dims.dp} x {m}; "
            f"try --global-batch {dims.dp * m * max(1, train.global_batch // (dims.dp * m))}")


def _check_sharded_data_parallel(parallel: ParallelConfig) -> None:
    """--zero / --fsdp / --mixed-precision: a known stage or strategy, a data-parallel group to shard over, a
    2-D dp_replicate x dp_shard mesh exactly for the hybrid strategies."""
    from parallelisms.parallel.fsdp import HYBRID, STRATEGIES

    dims, zero, fsdp = parallel.dims, parallel.zero, parallel.fsdp
    two_d = dims.dp_replicate > 1 and dims.dp_shard > 1
    require(zero in (0, 1, 2, 3), f"--zero {zero} is not a ZeRO stage; use 1, 2 or 3 (or 0 for plain DDP)")
    require(fsdp is None or fsdp in STRATEGIES, f"unknown --fsdp strategy {fsdp!r}; choose one of {', '.join(STRATEGIES)}")
    require(not (zero and fsdp), f"--zero {zero} and --fsdp {fsdp} both shard data parallelism; pick one "
                                 f"(--zero 3 is --fsdp full_shard, --zero 2 is close to shard_grad_op)")
    require(parallel.mixed_precision in ("fp32", "bf16"),
            f"unknown --mixed-precision {parallel.mixed_precision!r}; choose fp32 or bf16")
    require(parallel.mixed_precision == "fp32" or zero or fsdp,
            "--mixed-precision bf16 needs --zero or --fsdp (plain DDP trains in fp32); add --zero 1")
    require(parallel.mixed_precision == "fp32" or dims.tp == 1,
            f"--mixed-precision bf16 with --tp {dims.tp} is not supported: its bf16 partial sums have no "
            f"single-process reference to verify against (1.7e-2 off the bf16 one); use fp32 with --tp")
    require(not zero or dims.dp * dims.cp > 1,
            f"--zero {zero} shards over data-parallel ranks but the data-parallel degree is {dims.dp}; use --dp 2 or more")
    require(not zero or not two_d,
            f"--zero {zero} shards over one data-parallel dimension, but the layout is 2-D (dp_replicate "
            f"{dims.dp_replicate} x dp_shard {dims.dp_shard}); use --dp {dims.dp}, or --fsdp hybrid_shard for 2-D")
    if fsdp in HYBRID:
        require(two_d, f"--fsdp {fsdp} shards within dp_shard and replicates across dp_replicate, so it needs a 2-D "
                       f"layout with both above 1 (got dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}); "
                       f"use --dp-replicate 2 --dp-shard 2, or --fsdp full_shard for 1-D")
    else:
        require(not two_d, f"a 2-D data-parallel mesh (dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard}) "
                           f"needs --fsdp hybrid_shard or hybrid_shard_zero2; use a single --dp degree otherwise")
    require(fsdp is None or dims.dp * dims.cp > 1,
            f"--fsdp {fsdp} needs a data-parallel degree above 1, got {dims.dp}; use --dp 2 or more")
    require(not fsdp or dims.pp == 1,
            f"--fsdp {fsdp} combines with --dp, --tp and --cp only so far (got {dims.describe()}); drop --pp, "
            f"or use --zero 1, which composes with --pp")
    require(not (zero or fsdp) or dims.cp == 1 or (fsdp not in HYBRID and parallel.fsdp_style == "flat"),
            f"--cp {dims.cp} with --fsdp {fsdp} --fsdp-style {parallel.fsdp_style} is not supported; with --cp "
            f"use --zero 1/2/3 or a 1-D --fsdp strategy in the flat style")
    require(not (zero or fsdp) or dims.tp == 1 or parallel.fsdp_style in ("flat", "per_param"),
            f"--fsdp-style {parallel.fsdp_style} with --tp {dims.tp} is not supported; use --fsdp-style flat or "
            f"per_param, which shard the tensor-parallel shards")
    require(not (zero or fsdp) or parallel.fsdp_style == "flat" or fsdp is not None,
            f"--fsdp-style {parallel.fsdp_style} applies to --fsdp; --zero uses flat parameters")
    require(parallel.fsdp_style in ("flat", "per_param", "reuse"),
            f"unknown --fsdp-style {parallel.fsdp_style!r}; choose flat, per_param or reuse")
    if parallel.fsdp_style != "flat":
        strategies = ("full_shard",) if parallel.fsdp_style == "reuse" else ("full_shard", "shard_grad_op")
        require(fsdp in strategies, f"--fsdp-style {parallel.fsdp_style} runs --fsdp {' or '.join(strategies)}, "
                                    f"got {fsdp}; use --fsdp-style flat for the others")
        require(parallel.mixed_precision == "fp32", f"--fsdp-style {parallel.fsdp_style} trains in fp32 only; "
                                                    f"use --fsdp-style flat for --mixed-precision bf16")


def _check_tensor_parallel(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """Heads, KV heads and FFN width split evenly over --tp (vocab is padded instead); --sp needs tp > 1 and
    a sequence length that tp divides."""
    tp = parallel.dims.tp
    require(not parallel.sequence_parallel or tp > 1, "--sp (sequence parallelism) needs --tp > 1; add --tp 2")
    require(not parallel.tp_overlap or tp > 1, "--tp-overlap needs --tp > 1; add --tp 2")
    if tp == 1:
        return
    require(model.n_heads % tp == 0,
            f"--tp {tp} must divide n_heads {model.n_heads}; try --tp in {_divisors(model.n_heads)}")
    kv = model.n_kv_heads
    if tp <= kv:
        require(kv % tp == 0, f"--tp {tp} must divide n_kv_heads {kv} (or be a multiple of it, replicating KV heads); "
                              f"try --tp in {[d for d in _divisors(model.n_heads) if kv % d == 0 or d % kv == 0]}")
    else:
        require(tp % kv == 0 and (kv * model.head_dim) % tp == 0,
                f"--tp {tp} exceeds n_kv_heads {kv}, so KV heads are replicated, which needs tp a multiple of "
                f"n_kv_heads and kv_heads x head_dim = {kv * model.head_dim} divisible by tp; "
                f"try --tp in {[d for d in _divisors(model.n_heads) if kv % d == 0 or d % kv == 0]}")
    require(model.ffn_dim % tp == 0,
            f"--tp {tp} must divide the FFN width {model.ffn_dim}; try --tp in {_divisors(model.ffn_dim)}")
    require(not parallel.sequence_parallel or train.seq_len % tp == 0,
            f"--sp shards the sequence over --tp {tp}, so seq_len {train.seq_len} must be divisible by it; "
            f"try --seq-len {max(tp, train.seq_len // tp * tp)}")


def _check_context_parallel(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """--cp / --cp-attention: a sequence the ring's zigzag chunks (or Ulysses' contiguous chunks) divide, and
    for Ulysses heads the degree divides (after tensor parallelism has split them)."""
    from parallelisms.parallel.context import check_context_parallel

    dims = parallel.dims
    require(parallel.cp_attention in ("ring", "ulysses"),
            f"unknown --cp-attention {parallel.cp_attention!r}; choose ring or ulysses")
    if dims.cp == 1:
        return
    require(not parallel.sequence_parallel, f"--cp {dims.cp} with --sp is not supported yet; drop --sp")
    check_context_parallel(parallel.cp_attention, dims.cp, model.n_heads // dims.tp,
                           max(1, model.n_kv_heads // dims.tp), train.seq_len)


def _check_expert_parallel(parallel: ParallelConfig, model: ModelConfig) -> None:
    """--ep: an MoE model whose experts split evenly; MoE models compose with dp and ep only so far."""
    dims = parallel.dims
    if dims.ep > 1:
        require(model.n_experts > 0, f"--ep {dims.ep} needs a mixture-of-experts model, but this one is dense; "
                                     f"use --preset tiny-moe or a config with num_local_experts")
        require(model.n_experts % dims.ep == 0,
                f"--ep {dims.ep} must divide n_experts {model.n_experts}; "
                f"try --ep in {[d for d in _divisors(model.n_experts) if d > 1]}")
    if model.n_experts:
        require(dims.tp == dims.pp == dims.cp == 1,
                f"a mixture-of-experts model runs with --dp, --ep, --zero and --fsdp only so far, got "
                f"{dims.describe()}; drop --tp/--pp/--cp")
        require(dims.ep == 1 or not (parallel.zero or parallel.fsdp),
                f"--zero/--fsdp with --ep {dims.ep} is not supported yet (expert weights would need sharding over "
                f"the ranks holding the same experts); use --ep 1 with --zero/--fsdp, or --ep without them")
