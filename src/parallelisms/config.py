"""Model and training configuration, presets, Hugging Face ``config.json`` loading, and validation.

Every check here runs before any process starts and fails with :class:`ConfigError`, whose message is
one line: the constraint that failed, the values, and what would work.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from parallelisms.errors import ConfigError, divisors, path_kind, require, require_finite
from parallelisms.flags import Flag, integer, number, number_pair, slow_rank
from parallelisms.hf_arch import architecture_fields, check_architecture
from parallelisms.hf_keys import check_config_keys
from parallelisms.mesh import ParallelDims
from parallelisms.options import (Balance, Dtype, FsdpStrategy, FsdpStyle, LrSchedule, NonFinite, PpBalance,
                                  Precision, Recompute, Schedule, choices, coerce)


MAX_MODEL_INT = 2**31 - 1
MLPS = ("swiglu", "gelu")  # a model dimension beyond int32 is a typo, and keeps every size a finite float


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (Llama family: RMSNorm, RoPE, GQA, SwiGLU or GELU MLP, output head untied or tied)."""

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
    router_skew: float = 0.0           # a fixed logit bias toward the first quarter of the experts (bench ep-balance)
    mlp: str = "swiglu"                # swiglu (three matrices, Llama) or gelu (two matrices, GPT-2/3)
    # Hugging Face architecture features (parallelisms.hf_arch reads them from a config.json)
    head_dim_override: int = 0         # 0: dim // n_heads; else the head size (Qwen3, Mistral: q width n_heads x it)
    qkv_bias: bool = False             # biases on the query/key/value projections (Qwen2, attention_bias)
    out_bias: bool = False             # a bias on the attention output projection (Llama/Qwen3 attention_bias)
    qk_norm: bool = False              # RMSNorm over each query and key head before rotary positions (Qwen3)
    rope_scaling: str = "none"         # none, linear or llama3 (Llama 3.1's frequency-dependent scaling)
    rope_factor: float = 1.0           # linear and llama3: the context extension factor
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_len: int = 8192  # llama3: the pre-training context
    sliding_window: int = 0            # 0: none; else attention reaches this many tokens (runs need seq_len <= it)
    hf_model_type: str = "llama"       # the Hugging Face architecture an export writes (llama, mistral, qwen2, ...)
    tie_embeddings: bool = False       # the output head is the embedding table (tie_word_embeddings)

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output (n_heads x head_dim; dim unless head_dim is set)."""
        return self.n_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP: gate, up and down (SwiGLU), or up and down (GELU)."""
        return 3 if self.mlp == "swiglu" else 2

    def validate(self) -> "ModelConfig":
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_MODEL_INT,
                    f"model {name} must be an integer from 1 to {MAX_MODEL_INT:,}, got {value!r}")
        require(self.head_dim_override or self.dim % self.n_heads == 0,
                lambda: f"model dim {self.dim} must be divisible by n_heads {self.n_heads}; try n_heads in "
                        f"{divisors(self.dim)}, or give head_dim")
        require(self.n_heads % self.n_kv_heads == 0,
                lambda: f"n_heads {self.n_heads} must be divisible by n_kv_heads {self.n_kv_heads}; "
                        f"try n_kv_heads in {divisors(self.n_heads)}")
        require(self.mlp in MLPS, f"unknown --mlp {self.mlp!r}; choose {' or '.join(MLPS)}")
        require(self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for rotary positions")
        check_architecture(self)
        for name in ("rope_theta", "norm_eps"):
            require_finite(f"model {name}", getattr(self, name), above=0)
        if self.n_experts:
            require(isinstance(self.n_experts, int) and self.n_experts >= 2,
                    f"n_experts must be 0 (dense) or at least 2, got {self.n_experts}")
            require(self.mlp == "swiglu", f"--mlp {self.mlp} with experts: the experts are SwiGLU; use --mlp swiglu")
            require(1 <= self.top_k <= self.n_experts,
                    f"top_k {self.top_k} must be between 1 and n_experts {self.n_experts}")
            require_finite("capacity_factor", self.capacity_factor, at_least=0)
            require_finite("aux_loss_coef", self.aux_loss_coef, at_least=0)
            require_finite("router_skew", self.router_skew, at_least=0)
        return self

    def num_params(self) -> int:
        """Parameter count (embedding, attention, MLP, two norms per block, final norm, head)."""
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * (self.q_dim + 2 * kv) + self.q_dim * self.dim
        extras = ((self.q_dim + 2 * kv) * self.qkv_bias + self.dim * self.out_bias
                  + 2 * self.head_dim * self.qk_norm)
        mlp = self.mlp_matrices * self.dim * self.ffn_dim * max(1, self.n_experts) + self.dim * self.n_experts
        return ((1 if self.tie_embeddings else 2) * self.vocab_size * self.dim
                + self.n_layers * (attn + extras + mlp + 2 * self.dim) + self.dim)


def _gpt(layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=51200, dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                       ffn_dim=4 * hidden, max_seq_len=2048, mlp="gelu")


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
    "llama3-405b": ModelConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                               max_seq_len=8192, rope_theta=500000.0),
    # GPT-3 (Brown et al. 2020) and the Megatron shapes of Korthikanti et al. 2023 (Table 3): GELU MLP of 4h,
    # Megatron's padded vocabulary of 51,200.
    "gpt3-175b": _gpt(96, 12288, 96),
    "megatron-22b": _gpt(48, 6144, 64),
    "megatron-530b": _gpt(105, 20480, 128),
    "megatron-1t": _gpt(128, 25600, 160),
    "mixtral-8x7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                                max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2),
    # DeepSeek-V3's sizes (61 layers, h 7168, 256 routed experts of width 2048, top 8), with plain multi-head
    # attention instead of MLA and no shared expert: the shape, not the architecture.
    "deepseek-v3-moe": ModelConfig(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                                   ffn_dim=2048, max_seq_len=4096, n_experts=256, top_k=8),
}


def default_ffn(hidden: int, mlp: str) -> int:
    """The MLP width when only the hidden size is given: 4h for GELU (GPT), 8h/3 rounded up to a multiple of
    64 for SwiGLU (the same parameters as 4h with a third matrix; Shazeer 2020, Llama)."""
    return 4 * hidden if mlp == "gelu" else -(-8 * hidden // 3 // 64) * 64 if hidden >= 64 else -(-8 * hidden // 3)


def with_shape(base: ModelConfig, seq_len: int = 0, **fields) -> ModelConfig:
    """``base`` with the shape flags given, by field name (None: keep the base's). A new hidden size without
    ``ffn_dim`` takes the MLP's default width; new heads without ``n_kv_heads`` are plain multi-head attention;
    ``max_seq_len`` grows to ``seq_len``."""
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return base
    if "n_heads" in given and "n_kv_heads" not in given:
        given["n_kv_heads"] = given["n_heads"]
    if "ffn_dim" not in given and ("dim" in given or "mlp" in given):
        given["ffn_dim"] = default_ffn(given.get("dim", base.dim), given.get("mlp", base.mlp))
    return dataclasses.replace(base, max_seq_len=max(base.max_seq_len, seq_len), **given).validate()


def _shape(field_name: str, flag: str, text: str, low: int = 1) -> Flag:
    return Flag(field_name, f"{text}; overrides the preset/config", flag, integer(low, MAX_MODEL_INT), unset=True)


MODEL_FLAGS = (  # the shape flags, over --preset or --config (with_shape); ModelConfig's other fields are a file's
    _shape("n_layers", "--layers", "transformer blocks"),
    _shape("dim", "--hidden", "hidden size h"),
    _shape("n_heads", "--heads", "attention heads"),
    _shape("n_kv_heads", "--kv-heads", "key/value heads (default: --heads)"),
    _shape("head_dim_override", "--head-dim", "size of each attention head (default: hidden / heads; Qwen3 and "
                                              "Mistral set it)"),
    _shape("ffn_dim", "--ffn", "MLP width (default 4h for gelu, 8h/3 for swiglu)"),
    _shape("vocab_size", "--vocab", "vocabulary size"),
    _shape("n_experts", "--experts", "experts per MoE layer (0: dense)", low=0),
    _shape("top_k", "--topk", "experts per token"),
    Flag("mlp", "MLP: swiglu (Llama) or gelu (GPT, two matrices)", choices=MLPS, unset=True),
    Flag("tie_embeddings", "the output head is the embedding table (Hugging Face's tie_word_embeddings)"),
)


def with_positions(model: ModelConfig, seq_len: int) -> ModelConfig:
    """``model`` with rotary tables for at least ``seq_len`` positions: rotary positions extend past the
    preset's or config's max_position_embeddings, computed as ``transformers`` computes them."""
    return model if seq_len <= model.max_seq_len else dataclasses.replace(model, max_seq_len=seq_len)


def preset(name: str) -> ModelConfig:
    require(name in PRESETS, f"unknown --preset {name!r}; choose one of {', '.join(PRESETS)}")
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
    "tie_embeddings": ("tie_word_embeddings", False),
}


_HF_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read a Llama-family Hugging Face ``config.json`` into a :class:`ModelConfig`."""
    path = Path(path)
    require(not path.is_dir(), f"--config {str(path)!r} is a directory; pass the config.json file in it")
    require(path.is_file(), lambda: f"--config {str(path)!r} {path_kind(path)}; pass a Hugging Face config.json")
    try:
        raw = json.loads(path.read_text(), parse_constant=_refuse_constant)
    except OSError as exc:
        raise ConfigError(f"--config {str(path)!r} cannot be read ({exc.strerror}); pass a readable file") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"--config {str(path)!r} is not valid JSON ({exc.__class__.__name__}: "
                          f"{(str(exc).splitlines() or [''])[0][:100]})") from None
    require(isinstance(raw, dict), f"--config {str(path)!r} must hold a JSON object, got {type(raw).__name__}")
    check_config_keys(path, raw)  # keys that change the computation refused, unknown ones named
    missing = [hf for _, (hf, needed) in _HF_FIELDS.items() if needed and hf not in raw]
    require(not missing, f"--config {str(path)!r} lacks {', '.join(missing)}; a Llama-style config.json has them")
    values = {ours: raw[hf] for ours, (hf, _) in _HF_FIELDS.items() if hf in raw}
    values.setdefault("n_kv_heads", values["n_heads"])
    act = raw.get("hidden_act", raw.get("activation_function", "silu"))
    require(isinstance(act, str) and act in _HF_ACTS, f"--config {str(path)!r}: hidden_act {act!r} is not supported; "
                             f"choose one of {', '.join(_HF_ACTS)}")

    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}  # transformers 5 keeps rope_theta in it
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in raw:
        values["rope_theta"] = rope["rope_theta"]
    for name, value in values.items():
        field_name = _HF_FIELDS[name][0]
        if name == "tie_embeddings":
            require(isinstance(value, bool), f"config field {field_name} must be true or false, got {value!r}")
        elif name in ("rope_theta", "norm_eps"):
            require_finite(f"config field {field_name}", value, above=0)
            values[name] = float(value)
        else:
            low = 0 if name == "n_experts" else 1  # 0 experts: a dense model
            whole = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float)
                                                                                and value.is_integer())
            require(whole and low <= value <= MAX_MODEL_INT, f"config field {field_name} must be an integer from "
                                                             f"{low} to {MAX_MODEL_INT:,}, got {value!r}")
            values[name] = int(value)
    values.update(architecture_fields(path, raw, rope))
    return ModelConfig(**values, mlp=_HF_ACTS[act]).validate()


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


DTYPES = tuple(Dtype)  # parameter dtypes a run can train in
LR_SCHEDULES = tuple(LrSchedule)  # after --warmup (parallelisms.lr_schedule)


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from (``parallelisms.data.sources``): the built-in corpus (``path`` None), a text
    file, a directory of ``.txt`` files or a pre-tokenized ``.bin``; the held-out split and how often it is
    evaluated. Checked before launch by ``sources.check_data``."""

    path: str | None = None        # None: the built-in corpus
    bin_dtype: str = "uint16"      # element type of a pre-tokenized .bin (uint16 or uint32)
    tokenizer: str | None = None   # a Hugging Face tokenizer.json; None: UTF-8 bytes
    eval_split: float = 0.0        # fraction of the tokens held out (the last ones) for validation
    eval_every: int = 0            # steps between validation losses (0: never)
    eval_batches: int = 4          # global batches each validation averages over
    vocab_sweep: int = 0           # verify: every token id below this mixed into the batches (BatchLoader)


@dataclass(frozen=True)
class TrainConfig:
    """One training run: global batch, optimizer, steps, seeds."""

    steps: int = 20
    global_batch: int = 8          # sequences per optimizer step, over all data-parallel ranks
    seq_len: int = 64
    grad_accum: int = 1            # microbatches per step on each rank, no communication between them
    lr: float = 3e-3
    weight_decay: float = 0.01     # AdamW's decoupled decay, of the weight matrices only (parallelisms.optim)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    decay_all: bool = False        # decay every parameter, norms, biases and embeddings included
    grad_clip: float = 1.0         # global-norm clipping; 0 disables it
    seed: int = 0
    bucket_mb: float = 25.0        # data-parallel gradient bucket cap
    timeout_s: float = 300.0       # collective timeout
    dtype: Dtype = Dtype.FLOAT32   # parameter dtype: float32, or float64 (verify's tight contract)
    nonfinite: NonFinite = NonFinite.CONTINUE  # a non-finite loss or gradient: continue (verify finds where), stop or skip
    warmup: int = 0                # linear warmup steps of the learning rate
    lr_schedule: LrSchedule = LrSchedule.CONSTANT  # after warmup: constant, cosine or linear decay to min_lr at the last step
    min_lr: float = 0.0            # the decay's floor
    data: DataConfig = field(default_factory=DataConfig)
    slow_rank: tuple[int, float] | None = None  # (rank, factor): that rank's compute factor x slower (stragglers)

    def __post_init__(self):
        coerce(self)  # a valid string given for an enum-typed option becomes its member

    def validate(self, model: ModelConfig, dp: int = 1) -> "TrainConfig":
        require(isinstance(self.steps, int) and self.steps >= 1, f"--steps must be at least 1, got {self.steps}")
        require(self.global_batch >= 1, f"--global-batch must be at least 1, got {self.global_batch}")
        require(self.grad_accum >= 1, f"--grad-accum must be at least 1, got {self.grad_accum}")
        require(self.seq_len >= 2, f"--seq-len must be at least 2, got {self.seq_len}")
        require(self.seq_len <= model.max_seq_len,
                f"--seq-len {self.seq_len} exceeds the model's max_seq_len {model.max_seq_len}; use at most that, or "
                f"extend the model (with_positions)")
        require(not model.sliding_window or self.seq_len <= model.sliding_window,
                f"--seq-len {self.seq_len} exceeds the model's sliding_window {model.sliding_window} (config.json): "
                f"attention within a window is not implemented; use --seq-len at most {model.sliding_window}")
        per_step = dp * self.grad_accum
        require(self.global_batch % per_step == 0,
                f"--global-batch {self.global_batch} must be divisible by dp x grad_accum = {dp} x {self.grad_accum}; "
                f"try --global-batch {per_step * max(1, self.global_batch // per_step)}")
        require_finite("--lr (learning rate)", self.lr, above=0)
        require_finite("--grad-clip", self.grad_clip, at_least=0)
        require_finite("--weight-decay", self.weight_decay, at_least=0)
        require_finite("--eps", self.eps, above=0)
        require(len(self.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas),
                f"--betas {','.join(map(str, self.betas))} must be two numbers in [0, 1), e.g. 0.9,0.95")
        require_finite("--bucket-mb", self.bucket_mb, above=0)
        require_finite("--timeout (seconds)", self.timeout_s, above=0)
        require(self.dtype in DTYPES, f"unknown --dtype {self.dtype!r}; choose {choices(Dtype)}")
        require(self.lr_schedule in LR_SCHEDULES, f"unknown --lr-schedule {self.lr_schedule!r}; choose one of "
                                                  f"{', '.join(LR_SCHEDULES)}")
        require(self.nonfinite in tuple(NonFinite), f"unknown nonfinite {self.nonfinite!r}; choose {choices(NonFinite)}")
        require(self.min_lr <= self.lr, f"--min-lr {self.min_lr:g} exceeds --lr {self.lr:g}; use at most --lr")
        return self

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


COUNT = integer(1, 10**9)  # steps, batch sizes, lengths: bounded, so no later arithmetic overflows

TRAIN_FLAGS = (  # the training flags (the data and schedule flags are parallelisms.data.options')
    Flag("steps", "optimizer steps", parse=COUNT),
    Flag("global_batch", "sequences per step", parse=COUNT),
    Flag("seq_len", "tokens per sequence", parse=integer(2, 10**9)),
    Flag("grad_accum", "microbatches per rank per step", parse=COUNT),
    Flag("lr", "AdamW learning rate", parse=number(0, above=True)),
    Flag("grad_clip", "global-norm clip (0: off)", parse=number(0)),
    Flag("weight_decay", "AdamW's decoupled weight decay, of the weight matrices (not norms, biases, embeddings)",
         parse=number(0)),
    Flag("betas", "AdamW's betas", parse=number_pair(0, 1), metavar="B1,B2"),
    Flag("eps", "AdamW's epsilon", parse=number(0, above=True)),
    Flag("decay_all", "decay every parameter, norms and embeddings included"),
    # the data loader seeds step s with seed x 1_000_003 + s, which torch's 64-bit seeds hold for any seed below 2^32
    Flag("seed", "seed of the weights and the data", parse=integer(0, 2**32 - 1)),
    Flag("bucket_mb", "data-parallel gradient bucket cap", parse=number(0, 2**20, above=True)),
    Flag("timeout_s", "collective timeout, seconds", "--timeout", number(0, 10**6, above=True)),
    Flag("dtype", f"parameter dtype: {choices(Dtype)} (float64: rounding ~1e-16, so verify's contract tightens to "
                  f"1e-10)"),
    Flag("slow_rank", "make rank R's compute F times slower (real work; a straggler to see in the report)",
         parse=slow_rank, metavar="R:F"),
)


@dataclass(frozen=True)
class ParallelConfig:
    """The layout (``dims``) and the options of each parallelism, validated together before launch."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    find_unused_parameters: bool = False
    # tensor parallelism (issue: tensor parallel)
    sequence_parallel: bool = False
    tp_overlap: bool = False
    tp_overlap_chunks: int = 0         # >1: the forward's collectives too, pipelined with their GEMMs over chunks
    # sharded data parallelism (issue: ZeRO / FSDP)
    zero: int = 0                      # 0 (plain DDP), 1, 2, 3
    fsdp: FsdpStrategy | None = None   # full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_zero2
    fsdp_style: FsdpStyle = FsdpStyle.FLAT  # flat, per_param, reuse
    overlap_param_gather: bool = False  # ZeRO-1/2: the updated parameters' all-gather under the next forward
    fsdp_prefetch: int = 1             # ZeRO-3 / flat FSDP: units gathered ahead of the running one
    mixed_precision: Precision = Precision.FP32  # fp32, bf16
    # pipeline parallelism (issue: pipeline)
    schedule: Schedule = Schedule.ONE_F_ONE_B
    microbatches: int = 0              # 0: 2 x pp
    chunks: int = 1                    # virtual stages per rank (interleaved)
    pp_balance: PpBalance = PpBalance.LAYERS  # cut stages by equal layer counts, or by measured per-layer time
    # context parallelism
    cp_attention: str = "ring"         # a mode of parallelisms.parallel.cp_modes: ring, ulysses, allgather, ...
    cp_ulysses_size: int = 0           # hierarchical: the Ulysses (all-to-all) degree inside, ring across
    recompute: Recompute = Recompute.NONE  # activation recomputation: none, selective (attention core), full (block)
    # data-parallel balance (parallelisms.parallel.dp_balance): split each batch by measured speed
    dp_balance: Balance = Balance.EVEN  # even, or measured
    rebalance_every: int = 0           # steps between re-measured splits (0: the first measured split stays)
    # expert-parallel balance (parallelisms.parallel.ep_balance): experts placed by measured load, EPLB
    ep_balance: Balance = Balance.EVEN  # even, or measured
    ep_redundant: int = 0              # extra expert slots per ep rank (copies of the hottest experts)
    ep_rebalance_every: int = 0        # steps between re-measured placements (0: the first measured one stays)

    def __post_init__(self):
        coerce(self)

    def replace(self, **changes) -> "ParallelConfig":
        return dataclasses.replace(self, **changes)

    def one_tied_parameter(self) -> bool:
        """Whether a tied embedding and head (``tie_embeddings``) are one model parameter in this layout: one
        pipeline stage (a sharding engine serves the head from the embedding's unit); else the last stage holds
        a copy (:mod:`parallelisms.parallel.tied`)."""
        return self.dims.pp == 1

    def label(self) -> str:
        """The layout and every option that changes the computation: ``dp2 x tp2 +sp``, ``dpshard4 zero3``,
        ``dpshard2 fsdp full_shard per_param bf16``, ``cp2 ulysses``, ``pp2 zb-v``, ``dp2 recompute full``."""
        d = self.dims
        options = [
            "+sp" if self.sequence_parallel else "", "+tp-overlap" if self.tp_overlap else "",
            f"forward x{self.tp_overlap_chunks}" if self.tp_overlap_chunks > 1 else "",
            f"zero{self.zero}" if self.zero else "", "+overlap-param-gather" if self.overlap_param_gather else "",
            f"fsdp {self.fsdp}" if self.fsdp else "",
            self.fsdp_style if self.fsdp and self.fsdp_style is not FsdpStyle.FLAT else "",
            f"prefetch {self.fsdp_prefetch}" if self.fsdp_prefetch > 1 else "",
            self.cp_attention if d.cp > 1 else "",
            self.schedule if d.pp > 1 else "",
            f"{self.microbatches} microbatches" if d.pp > 1 and self.microbatches else "",
            f"{self.chunks} chunks" if d.pp > 1 and self.chunks > 1 else "",
            "balance measured" if d.pp > 1 and self.pp_balance is PpBalance.MEASURED else "",
            f"recompute {self.recompute}" if self.recompute is not Recompute.NONE else "",
            "dp-balance measured" if self.dp_balance is Balance.MEASURED else "",
            "ep-balance measured" if self.ep_balance is Balance.MEASURED else "",
            f"+{self.ep_redundant} redundant" if self.ep_redundant else "",
            "bf16" if self.mixed_precision is Precision.BF16 else "",
        ]
        return " ".join([d.describe(" x "), *filter(None, options)])
