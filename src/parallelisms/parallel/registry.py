"""The parallelisms, one descriptor each, in a module without torch: the command line reads it to build its
layout flags and check a layout before any process starts, and the support table reads the pairs that cannot
run together from it.

A descriptor holds a parallelism's name, its mesh dimension and degree flag, its options (the
:class:`~parallelisms.config.ParallelConfig` fields it owns: their flags, help and parsers; their types and
defaults are the config's, an enum's values its choices), its rules (a function of
:mod:`parallelisms.parallel.checks`), the features it switches on (the support table's names, each with the flag
a user writes and the smallest layout that switches it on, the test layouts' row), the pairs it cannot run with,
where its transform lives (``module:function``; a module swap, ``module_swap``, is applied by
:func:`parallelisms.train_setup.parallelize` in the registry's order, see :func:`module_swaps`) and
where the performance model finds the collectives it makes per step (``volumes``, in
:mod:`parallelisms.perf.volumes`; :func:`parallelisms.perf.model.comm_per_step` adds them up).
Recomputation and mixed precision, options of the layout that are not parallelisms, are described the same way.
A new parallelism is its modules and one entry in :data:`PARALLELISMS`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.errors import require
from parallelisms.flags import FlagName, integer
from parallelisms.options import Dtype, FsdpStrategy, FsdpStyle, Precision, Recompute, Schedule, choices, enum_fields
from parallelisms.parallel import checks
from parallelisms.parallel.cp_modes import MODES

COUNT = integer(1, 10**9)
LAYOUT = "layout (world size = pp x dp x cp x tp)"  # the --help group of the degrees


@dataclass(frozen=True)
class Option(FlagName):
    """A ParallelConfig field as a flag. ``help`` may name ``{choices}`` (the values, from the field's enum or
    ``values``) and ``{default}``; ``needs``: the degree it applies to (given without it above 1, the command
    line refuses it; unset, the config's default holds)."""
    field: str
    help: str
    flag: str = ""                      # default: --the-field-name
    parse: Callable | None = None       # the parser of a number
    needs: str = ""
    group: str = ""                     # the --help group (default: the parallelism's)
    values: tuple[str, ...] = ()        # a registry's keys, for a field typed str

    @property
    def default(self):
        return ParallelConfig.__dataclass_fields__[self.field].default

    @property
    def enum(self) -> type[StrEnum] | None:
        return enum_fields(ParallelConfig).get(self.field)

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self.enum) if self.enum else self.values

    def describe(self) -> str:
        listed = choices(self.enum) if self.enum else ", ".join(self.values)
        return self.help.format(choices=listed, default=self.default)

    def arguments(self) -> dict:
        """``add_argument``'s keywords: a switch for a bool, else the parser and the default (None for an
        option that needs a degree: given or not is known)."""
        if isinstance(self.default, bool):
            return dict(action="store_true", help=self.describe())
        listed = dict(metavar="{" + ",".join(self.choices) + "}") if self.choices else {}
        return dict(type=self.parse or str, default=None if self.needs else self.default, help=self.describe(),
                    **listed)


@dataclass(frozen=True)
class Feature:
    """A support-table feature: the flag a user writes for it, and the smallest layout that switches it on
    (mesh degrees, ParallelConfig options, a mixture-of-experts model, TrainConfig fields): a test layout's row."""
    flag: str
    dims: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    moe: bool = False
    train: dict = field(default_factory=dict)


Check = Callable[[ParallelConfig, ModelConfig, TrainConfig], None]
Switched = Callable[[ModelConfig, TrainConfig, ParallelConfig], list[str]]


@dataclass(frozen=True)
class Parallelism:
    """One parallelism as the command line, the support table and the tests read it (the module docstring)."""
    name: str
    dim: str | None            # its mesh dimension (a ParallelDims field; None: not a parallelism)
    title: str                 # its options' --help group
    options: tuple[Option, ...]
    check: Check | None        # its rules: one-line ConfigErrors
    switched: Switched         # the features of ``features`` this layout switches on
    features: dict[str, Feature]
    transform: str             # "module:function"
    excludes: dict[frozenset, str] = field(default_factory=dict)  # pairs of features that cannot run, why
    degree: str = ""           # "tensor": the --tp flag's "tensor-parallel degree" (the dp flags are the CLI's)
    module_swap: bool = False  # ``transform`` swaps modules of the full model: f(model, comms, parallel, train)
    volumes: str = ""          # "module:function": its collectives per step for perf/ (none: it makes none of its own)


def pairs(left, right, reason: str) -> dict[frozenset, str]:
    """Every feature of ``left`` with every one of ``right`` (a name or a list), for ``reason``."""
    left, right = ([left] if isinstance(left, str) else left), ([right] if isinstance(right, str) else right)
    return {frozenset((a, b)): reason for a in left for b in right}


def _on(*named: tuple[str, bool]) -> list[str]:
    return [name for name, on in named if on]


_ZERO = [f"zero{s}" for s in (1, 2, 3)]
_FSDP = [f"fsdp-{s}" for s in FsdpStrategy]
_STYLES = [str(FsdpStyle.PER_PARAM), str(FsdpStyle.REUSE)]
SHARDED = "sharded data parallelism"

DATA = Parallelism(
    "data", "dp_replicate", "data-parallel balance", (
        Option("find_unused_parameters", "treat parameters with no gradient as zero instead of raising", group=LAYOUT),
        Option("dp_balance", "how each global batch splits over the data-parallel ranks: {choices} (measured: in "
                             "proportion to each rank's measured speed)"),
        Option("rebalance_every", "with --dp-balance measured: re-measure and re-split every N steps (0: once, "
                                  "then until it settles)",
               parse=integer(0, 10**9))),
    checks.check_data_parallel,
    lambda m, t, p: _on(("ddp", p.dims.dp > 1 and not (p.zero or p.fsdp))),
    {"ddp": Feature("--dp (DDP)", {"dp_replicate": 2})},
    "parallelisms.parallel.data:DataParallel", volumes="parallelisms.perf.volumes:ddp")

ZERO = Parallelism(
    "zero", "dp_shard", SHARDED, (
        Option("zero", "ZeRO stage 1, 2 or 3", parse=integer(0, 3)),
        Option("overlap_param_gather", "--zero 1/2: all-gather the updated parameters under the next forward "
                                       "(Megatron's)")),
    checks.check_zero,
    lambda m, t, p: [f"zero{p.zero}"] if p.zero else [],
    {f"zero{s}": Feature(f"--zero {s}", {"dp_shard": 2}, {"zero": s}) for s in (1, 2, 3)},
    "parallelisms.parallel.zero:sharded_grad_sync",
    pairs(_ZERO, _FSDP + _STYLES, "two ways to shard the same data-parallel state: pick one (--zero 3 is --fsdp "
                                  "full_shard, --zero 2 is close to shard_grad_op)"),
    volumes="parallelisms.perf.volumes:zero")

FSDP = Parallelism(
    "fsdp", "dp_shard", SHARDED, (
        Option("fsdp", "FSDP's sharding strategy: {choices} (the hybrid ones on a 2-D --dp-replicate x "
                       "--dp-shard mesh)"),
        Option("fsdp_prefetch", "ZeRO-3 / flat FSDP: units whose parameters are gathered ahead of the running one",
               parse=integer(1, 64)),
        Option("fsdp_style", "{choices}: FSDP1's flat parameters, FSDP2's per-parameter shards or YaFSDP's "
                             "reused buffers")),
    checks.check_fsdp,
    lambda m, t, p: ([f"fsdp-{p.fsdp}"] if p.fsdp else []) + ([str(p.fsdp_style)] if p.fsdp_style in _STYLES else []),
    {**{f"fsdp-{s}": Feature(f"--fsdp {s}", {"dp_replicate": 2, "dp_shard": 2} if s.hybrid else {"dp_shard": 2},
                             {"fsdp": s}) for s in FsdpStrategy},
     **{s: Feature(f"--fsdp-style {s}", {"dp_shard": 2}, {"fsdp": FsdpStrategy.FULL_SHARD, "fsdp_style": s})
        for s in _STYLES}},
    "parallelisms.parallel.fsdp:fsdp_plan", volumes="parallelisms.perf.volumes:fsdp")

TENSOR = Parallelism(
    "tensor", "tp", "tensor parallelism", (
        Option("tp_overlap", "overlap the input-gradient all-reduce with dW"),
        Option("tp_overlap_chunks", "with --tp-overlap: hide the forward's collectives too, pipelined with their "
                                    "GEMMs over N chunks", parse=integer(0, 64))),
    checks.check_tensor_parallel,
    lambda m, t, p: _on(("tp", p.dims.tp > 1), ("tp-overlap", p.tp_overlap)),
    {"tp": Feature("--tp", {"tp": 2}), "tp-overlap": Feature("--tp-overlap", {"tp": 2}, {"tp_overlap": True})},
    "parallelisms.parallel.tensor_plan:tensor_parallel_swap", degree="tensor", module_swap=True,
    volumes="parallelisms.perf.volumes:tensor_parallel")

SEQUENCE = Parallelism(  # Megatron's: the tensor-parallel group shards the sequence between its regions
    "sequence", "tp", "tensor parallelism",
    (Option("sequence_parallel", "Megatron sequence parallelism (needs --tp > 1)", flag="--sp"),),
    None,  # its rules are tensor parallelism's
    lambda m, t, p: _on(("sp", p.sequence_parallel)),
    {"sp": Feature("--sp", {"tp": 2}, {"sequence_parallel": True})},
    "parallelisms.parallel.tensor_plan:tensor_parallel_swap")  # tensor parallelism's swap applies it

CONTEXT = Parallelism(
    "context", "cp", "context parallelism", (
        Option("cp_attention", "; ".join(f"{m.name}: {m.summary}" for m in MODES.values()), needs="cp",
               values=tuple(MODES)),
        Option("cp_ulysses_size", "hierarchical: the all-to-all degree inside (a divisor of --cp)", parse=COUNT,
               needs="cp")),
    checks.check_context_parallel,
    lambda m, t, p: [p.cp_attention] if p.dims.cp > 1 else [],
    {**{name: Feature(f"--cp-attention {name}", {"cp": 4 if name == "hierarchical" else 2},
                      {"cp_attention": name, "cp_ulysses_size": 2 if name == "hierarchical" else 0})
        for name in MODES},
     "ring": Feature("--cp (ring)", {"cp": 2}, {"cp_attention": "ring"})},
    "parallelisms.parallel.context:context_parallel_swap", degree="context", module_swap=True,
    volumes="parallelisms.perf.volumes:context_parallel")

EXPERT = Parallelism(
    "expert", "ep", "expert-parallel balance", (
        Option("ep_balance", "how experts are placed over --ep: {choices} (measured: by the tokens measured per "
                             "expert, EPLB-style)"),
        Option("ep_redundant", "with --ep-balance measured: extra expert slots per ep rank, for copies of the "
                               "hottest experts", parse=integer(0, 10**6)),
        Option("ep_rebalance_every", "with --ep-balance measured: re-measure and re-place every N steps (0: once)",
               parse=integer(0, 10**9))),
    checks.check_expert_parallel,
    lambda m, t, p: _on(("moe", m.n_experts > 0), ("ep", p.dims.ep > 1)),
    {"moe": Feature("a mixture-of-experts model", moe=True), "ep": Feature("--ep", {"ep": 2}, moe=True)},
    "parallelisms.parallel.ep_balance:expert_parallel_swap", degree="expert", module_swap=True,
    volumes="parallelisms.perf.volumes:expert_parallel")

PIPELINE = Parallelism(
    "pipeline", "pp", "pipeline parallelism", (
        Option("schedule", "{choices} (default {default})", needs="pp"),
        Option("microbatches", "microbatches per step (default 2 x pp)", parse=COUNT, needs="pp"),
        Option("chunks", "virtual stages per rank (interleaved: 2 or more)", parse=COUNT, needs="pp"),
        Option("pp_balance", "{choices}: cut stages by equal layer counts (default) or by per-layer "
                             "forward+backward time measured on rank 0", needs="pp")),
    checks.check_pipeline,
    lambda m, t, p: ["pp", p.schedule] if p.dims.pp > 1 else [],
    {"pp": Feature("--pp", {"pp": 2}),
     **{str(s): Feature(f"--schedule {s}", {"pp": 2}, {"schedule": s, "chunks": 2 if s is Schedule.INTERLEAVED else 1})
        for s in Schedule}},
    "parallelisms.parallel.pipeline.runner:cut_stages",
    pairs(str(Schedule.PIPEDREAM), _ZERO + _STYLES + _FSDP, "PipeDream updates a stage after every microbatch and "
          "stashes a full copy of each weight version in flight, so sharded weights would be gathered, kept whole "
          "and re-sharded per microbatch: no memory saved, every update a full collective"),
    degree="pipeline", volumes="parallelisms.perf.volumes:pipeline_parallel")

RECOMPUTE = Parallelism(
    "recompute", None, "activation memory", (Option("recompute", "activation recomputation: {choices}"),),
    None,
    lambda m, t, p: [f"recompute-{p.recompute}"] if p.recompute is not Recompute.NONE else [],
    {f"recompute-{r}": Feature(f"--recompute {r}", options={"recompute": r}) for r in Recompute
     if r is not Recompute.NONE},
    "parallelisms.parallel.recompute:recompute_swap", module_swap=True)

PRECISION = Parallelism(
    "precision", None, SHARDED,
    (Option("mixed_precision", "{choices} (bf16 compute, fp32 master weights)"),),
    None,
    lambda m, t, p: _on(("bf16", p.mixed_precision is Precision.BF16), ("float64", t.dtype is Dtype.FLOAT64)),
    {"bf16": Feature("--mixed-precision bf16", options={"mixed_precision": Precision.BF16}),
     "float64": Feature("--dtype float64", train={"dtype": Dtype.FLOAT64})},
    "parallelisms.parallel.zero:sharded_grad_sync",  # bf16 compute over fp32 master weights: the flat engine's
    pairs("bf16", "float64", "mixed precision keeps float32 master weights"))

PARALLELISMS: dict[str, Parallelism] = {p.name: p for p in (
    DATA, ZERO, FSDP, TENSOR, SEQUENCE, CONTEXT, EXPERT, PIPELINE, RECOMPUTE, PRECISION)}
OPTIONS: dict[str, Option] = {o.field: o for p in PARALLELISMS.values() for o in p.options}


def check_values(parallel: ParallelConfig) -> None:
    """Every option with named values holds one of them (the support table names features by them)."""
    for option in OPTIONS.values():
        value = getattr(parallel, option.field)
        if option.choices and not (value is None and option.default is None):
            require(value in option.choices,
                    f"unknown {option.name} {value!r}; choose one of {', '.join(option.choices)}")


def parallel_config(dims, **options) -> ParallelConfig:
    """A ParallelConfig of ``dims`` and the options given by field name (an option left out, or None for one
    that needs a degree, keeps the config's default)."""
    unknown = sorted(set(options) - set(OPTIONS))
    require(not unknown, f"unknown layout option(s) {', '.join(unknown)}; choose from {', '.join(OPTIONS)}")
    given = {k: v for k, v in options.items() if not (v is None and OPTIONS[k].needs)}
    return dataclasses.replace(ParallelConfig(dims=dims), **given)


def module_swaps() -> list[Callable]:
    """The transforms that swap modules of the full seeded model before the pipeline cut, in the registry's order
    (tensor and sequence, context, expert, recomputation): each ``f(model, comms, parallel, train)`` changes the
    model in place when the layout asks for it and returns None, or the positions of this rank's tokens where it
    reorders the sequence (context parallelism). A new parallelism's swap applies by its descriptor alone."""
    import importlib

    def load(path: str) -> Callable:
        module, function = path.split(":")
        return getattr(importlib.import_module(module), function)
    return [load(p.transform) for p in PARALLELISMS.values() if p.module_swap]


@dataclass(frozen=True)
class Row:
    """A parallelism's row of README's feature table (:func:`parallelisms.support.feature_rows_markdown`): its name
    there, what it covers (the mechanisms and options built), its docs page and the page's short name."""
    title: str
    covers: str
    page: str
    link: str
    state: str = "works"  # implemented, verified against single-process training, reachable from the CLI


ROWS: dict[str, Row] = {  # by descriptor name; every descriptor has one (tests/test_support.py)
    "data": Row("Data parallel", "buckets in gradient-ready order, async all-reduce from hooks, `no_sync` "
                                 "accumulation", "docs/parallelisms/dp.md", "dp"),
    "zero": Row("ZeRO-1/2/3", "one flat engine: sharded AdamW, bucketed reduce-scatter, per-block gather with "
                              "prefetch", "docs/parallelisms/zero-fsdp.md", "zero"),
    "fsdp": Row("FSDP", "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD(_ZERO2); per-parameter; reuse; "
                        "`--fsdp-prefetch N`", "docs/parallelisms/zero-fsdp.md", "fsdp"),
    "tensor": Row("Tensor parallel", "column/row linear, attention by heads, vocab-parallel loss; "
                                     "`--tp-overlap(-chunks)`", "docs/parallelisms/tp-sp.md", "tp"),
    "sequence": Row("Sequence parallel", "all-gather / reduce-scatter around TP regions, chunked behind the GEMMs; "
                                         "with cp, pp", "docs/parallelisms/tp-sp.md", "sp"),
    "context": Row("Context parallel", "ring (zigzag, exact merge), Ulysses, all-gather (Llama 3), hierarchical "
                                       "Ulysses x ring (USP)", "docs/parallelisms/cp.md", "cp"),
    "expert": Row("Expert parallel", "top-k router, capacity, aux loss, grouped GEMM, all-to-all; EPLB placement "
                                     "(bf16; every schedule)", "docs/parallelisms/ep.md", "ep"),
    "pipeline": Row("Pipeline parallel", "GPipe to DualPipe(V) and PipeDream; each stage under the whole-model dp "
                                         "engines; measured balance", "docs/parallelisms/pp.md", "pp"),
    "recompute": Row("Activation recomputation", "`--recompute selective\\|full`, under every sharding style and "
                                                 "synchronous schedule", "docs/parallelisms/recompute.md", "recompute"),
    "precision": Row("Mixed precision", "`--mixed-precision bf16`: bf16 compute, fp32 master weights and reductions",
                     "docs/verify.md", "verify"),
}
