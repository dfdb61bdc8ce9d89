"""``parallelisms plan --gpus N``: search the layouts of N GPUs for the fastest that fits, with the step model.

Every layout flag given is fixed; the rest are searched: tp (within a node), pp, cp, dp, ep (MoE), sequence
parallelism, ZeRO stage (and ZeRO-3 as HSDP: sharded within a node, replicated across nodes), recompute mode,
pipeline schedule and chunks (uneven stages where the layers do not divide, as the runtime cuts them: perf.stages),
microbatches (or gradient accumulation without a pipeline). Context parallelism is
searched only where no layout without it fits (long sequences, as the Llama 3 runs used it): the ring's
per-block merges and grouped-query repeats, eager operators on a GPU, are not priced, so a cp layout is not
proposed on compute grounds. Two passes keep the search fast: every candidate is priced with the pipeline's closed forms
(bubble (p-1)(F+B+W)/v, zero-bubble's (p-1)(F+B-W) and (p-1)(F+B-2W), in-flight microbatches p, 2p-1, m), the
fitting ones are sorted, and the best are re-priced with the schedule simulator and checked against the
support table (support.validate_layout) until enough pass. Only layouts that fit and run are proposed; when
none fits, the message says by how much the leanest misses.
"""

from __future__ import annotations

import dataclasses
import math

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.errors import ConfigError, divisors, require
from parallelisms.flags import Flag, add_flags, integer
from parallelisms.mesh import ParallelDims
from parallelisms.options import FsdpStyle, Precision
from parallelisms.perf.estimate import bottleneck, estimate
from parallelisms.perf.hardware import Hardware
from parallelisms.perf.step import predict_step

SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1), ("zb-h2", 1))
RECOMPUTE = ("none", "selective", "full")
LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "ep", "sp", "zero", "recompute", "schedule", "chunks", "microbatches",
               "grad_accum")  # and "hsdp": the shard degree of a hybrid-sharded (HSDP) layout, 0 otherwise


@dataclasses.dataclass(frozen=True)
class Fixed:
    """The layout flags the user gave (None: searched)."""
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    sp: bool | None = None
    zero: int | None = None
    recompute: str | None = None
    schedule: str | None = None
    chunks: int | None = None
    microbatches: int | None = None
    grad_accum: int | None = None


def _pick(fixed, options):
    return [fixed] if fixed is not None else list(options)


def _degrees(gpus: int, cfg: ModelConfig, train: TrainConfig, hw: Hardware, fixed: Fixed):
    """(dp, tp, pp, cp, ep) whose product is ``gpus``, each dividing what it splits."""
    for tp in _pick(fixed.tp, [d for d in divisors(gpus) if d <= hw.gpus_per_node]):
        for pp in _pick(fixed.pp, [d for d in divisors(gpus // tp) if _balanced(cfg.n_layers, d)]):
            for cp in _pick(fixed.cp, [d for d in (1, 2, 4, 8) if train.seq_len % (2 * d) == 0 or d == 1]):
                rest, left = divmod(gpus, tp * pp * cp)
                dp = rest if fixed.dp is None else fixed.dp
                if left or dp != rest or train.global_batch % dp:
                    continue
                eps = [d for d in divisors(dp * cp) if cfg.n_experts % d == 0] if cfg.n_experts else [1]
                for ep in _pick(fixed.ep, eps):
                    yield dp, tp, pp, cp, ep


def _balanced(layers: int, pp: int) -> bool:
    """Whether ``pp`` stages cut ``layers`` (the runtime's equal split: the first stages one layer longer where
    they do not divide) leave the longest stage at most 1/8 above the mean (Llama 3's 126 layers on 16 stages:
    8 against 7.9); a more uneven cut idles every other stage that long, so it is not searched."""
    return pp <= layers and math.ceil(layers / pp) <= 1.125 * layers / pp


def _shardings(dp: int, tp: int, cp: int, hw: Hardware, fixed: Fixed):
    """(zero stage, HSDP shard degree) of each data-parallel sharding: ZeRO 0-3 over all of dp, and ZeRO-3 as
    HSDP (PyTorch FSDP's hybrid_shard) over the data-parallel ranks of one node where dp spans more."""
    for zero in _pick(fixed.zero, (0, 1, 2, 3) if dp > 1 else (0,)):
        yield zero, 0
        node = hw.gpus_per_node // (tp * cp)
        if zero == 3 and 1 < node < dp and dp % node == 0:
            yield zero, node


def _variants(cfg: ModelConfig, train: TrainConfig, dims, fixed: Fixed, hw: Hardware):
    dp, tp, pp, cp, ep = dims
    per_rank = train.global_batch // dp
    splits = [m for m in divisors(per_rank) if m & (m - 1) == 0 or m == per_rank]
    for sp in _pick(fixed.sp, (True, False) if tp > 1 else (False,)):
        for zero, hsdp in _shardings(dp, tp, cp, hw, fixed):
            for recompute in _pick(fixed.recompute, RECOMPUTE):
                if pp == 1:
                    for accum in _pick(fixed.grad_accum, splits):
                        yield dict(sp=sp, zero=zero, hsdp=hsdp, recompute=recompute, schedule=None, chunks=1,
                                   microbatches=0, grad_accum=accum)
                    continue
                for schedule, chunks in SCHEDULES:
                    if (fixed.schedule not in (None, schedule) or fixed.chunks not in (None, chunks)
                            or cfg.n_layers < pp * chunks):  # uneven stages: the runtime's equal_bounds
                        continue
                    for m in _pick(fixed.microbatches, [m for m in splits if m % pp == 0]):
                        yield dict(sp=sp, zero=zero, hsdp=hsdp, recompute=recompute, schedule=schedule,
                                   chunks=chunks, microbatches=m, grad_accum=1)


def _config(dims, v: dict, base: ParallelConfig) -> ParallelConfig:
    dp, tp, pp, cp, ep = dims
    shard = v["hsdp"] or (dp if v["zero"] > 0 else 1)
    mesh = ParallelDims(dp_shard=shard, dp_replicate=dp // shard, tp=tp, pp=pp, cp=cp, ep=ep)
    options = dict(schedule=v["schedule"], chunks=v["chunks"], microbatches=v["microbatches"]) if pp > 1 else {}
    return dataclasses.replace(base, dims=mesh, sequence_parallel=v["sp"], zero=0 if v["hsdp"] else v["zero"],
                               recompute=v["recompute"], fsdp="hybrid_shard" if v["hsdp"] else None,
                               tp_overlap=base.tp_overlap and tp > 1,  # --tp-overlap (-chunks): where there is tp
                               tp_overlap_chunks=base.tp_overlap_chunks if base.tp_overlap and tp > 1 else 0,
                               overlap_param_gather=_overlaps_param_gather(pp, v), **options)


def _overlaps_param_gather(pp: int, v: dict) -> bool:
    """ZeRO-1/2 without a pipeline gather the updated parameters under the next forward (never slower)."""
    return v["zero"] in (1, 2) and pp == 1


def check_degrees(gpus: int, fixed: Fixed) -> None:
    """One line unless the fixed degrees can make ``gpus`` GPUs (before any search)."""
    if all(getattr(fixed, k) is not None for k in ("dp", "tp", "pp", "cp")):
        product = fixed.dp * fixed.tp * fixed.pp * fixed.cp
        require(product == gpus, f"--dp {fixed.dp} x --tp {fixed.tp} x --pp {fixed.pp} x --cp {fixed.cp} = {product}, "
                                 f"not --gpus {gpus}; give degrees whose product is {gpus}, or leave some out")
    given = {k: getattr(fixed, k) for k in ("tp", "pp", "cp", "dp") if getattr(fixed, k)}
    product = math.prod(given.values())
    require(gpus % product == 0, f"{' x '.join(f'--{k} {v}' for k, v in given.items())} = {product} does not divide "
                                 f"--gpus {gpus}; choose degrees that divide it")


def _search(cfg, train, base, hw, gpus: int, fixed: Fixed, attention: str, fp8: bool, kernels: str,
            cache: dict) -> tuple[list, tuple | None]:
    """(step, dims, variant) of every layout that fits, priced with the closed forms, and the leanest that does
    not (memory, dims, variant)."""
    fits, leanest = [], None
    for dims in _degrees(gpus, cfg, train, hw, fixed):
        for v in _variants(cfg, train, dims, fixed, hw):
            parallel = _config(dims, v, base)
            run = train.replace(grad_accum=v["grad_accum"])
            try:
                result = predict_step(cfg, parallel, run, hw, attention, simulate_schedule=False, cache=cache, fp8=fp8,
                                      kernels=kernels)
            except (ConfigError, ValueError, ZeroDivisionError):  # a shape this layout cannot split
                continue
            if result["fits"]:
                fits.append((result["step_s"], dims, v))
            elif leanest is None or result["memory_per_rank"]["total"] < leanest[0]:
                leanest = (result["memory_per_rank"]["total"], dims, v)
    return fits, leanest


def plan(cfg: ModelConfig, train: TrainConfig, base: ParallelConfig, hw: Hardware, gpus: int, fixed: Fixed,
         attention: str = "flash", top: int = 5, fp8: bool = False, kernels: str = "eager") -> list[dict]:
    """The ``top`` fastest layouts of ``gpus`` GPUs that fit and that the support table accepts, best first, each
    with its ``reason``: the step's bound and largest cost (:func:`bottleneck`)."""
    from parallelisms.support import validate_layout

    check_degrees(gpus, fixed)
    fits, leanest, cache = [], None, {}
    without_cp = [dataclasses.replace(fixed, cp=1)] if fixed.cp is None else []
    for search in without_cp + [fixed]:  # context parallelism only where nothing fits without it
        if fits:
            break
        fits, leanest = _search(cfg, train, base, hw, gpus, search, attention, fp8, kernels, cache)
    if not fits:
        need = "no layout could be formed" if leanest is None else (
            f"the leanest ({_flags(leanest[1], leanest[2], base)}) needs {leanest[0] / 2**30:,.1f} GiB per GPU, "
            f"{(leanest[0] - hw.memory_bytes) / 2**30:,.1f} GiB more than the {hw.memory_bytes / 2**30:,.1f} GiB of {hw.name}")
        raise ConfigError(f"no layout of {gpus} GPUs fits this model and batch: {need}; use more GPUs, a smaller "
                          f"--global-batch or --seq-len, or hardware with more memory")
    fits.sort(key=lambda f: f[0])
    plans = []
    for _, dims, v in fits:
        if len(plans) >= top:
            break
        parallel = _config(dims, v, base)
        run = train.replace(grad_accum=v["grad_accum"])
        try:
            parallel = validate_layout(cfg, run, parallel)
        except ConfigError:
            continue
        result = estimate(cfg, parallel, run, hw, attention, fp8=fp8, kernels=kernels)
        if result["fits"]:
            dp, tp, pp, cp, ep = dims
            plans.append({**dict(zip(LAYOUT_KEYS, (dp, tp, pp, cp, ep))), **v, "flags": _flags(dims, v, base),
                          "reason": bottleneck(result), **result})
    plans.sort(key=lambda p: p["step_s"])
    return plans


def _flags(dims, v: dict, base: ParallelConfig) -> str:
    """The layout flags of ``(dims, v)`` with ``base``'s options where they apply: with the model, batch and
    hardware flags given to plan, ``estimate`` with these prices exactly the layout plan priced."""
    dp, tp, pp, cp, ep = dims
    hsdp = v.get("hsdp", 0)
    data = [f"--dp-replicate {dp // hsdp}", f"--dp-shard {hsdp}"] if hsdp else [f"--dp {dp}"]
    out = data + [f"--tp {tp}", f"--pp {pp}", f"--cp {cp}"] + ([f"--ep {ep}"] if ep > 1 else [])
    out += ["--sp"] if v["sp"] else []
    out += ["--fsdp hybrid_shard"] if hsdp else [f"--zero {v['zero']}"] if v["zero"] else []
    out += ["--overlap-param-gather"] if _overlaps_param_gather(pp, v) else []
    out += [f"--recompute {v['recompute']}"] if v["recompute"] != "none" else []
    if pp > 1:
        out += [f"--schedule {v['schedule']}", f"--microbatches {v['microbatches']}"]
        out += [f"--chunks {v['chunks']}"] if v["schedule"] == "interleaved" else []
    elif v["grad_accum"] > 1:
        out.append(f"--grad-accum {v['grad_accum']}")
    priced = _config(dims, v, base)  # --tp-overlap (-chunks) where there is tp, as _config prices them
    out += ["--tp-overlap"] if priced.tp_overlap else []
    out += [f"--tp-overlap-chunks {priced.tp_overlap_chunks}"] if priced.tp_overlap_chunks else []
    out += [f"--cp-attention {priced.cp_attention}"] if cp > 1 else []
    out += [f"--fsdp-style {priced.fsdp_style}"] if hsdp and priced.fsdp_style is not FsdpStyle.FLAT else []
    out += [f"--mixed-precision {priced.mixed_precision}"] if priced.mixed_precision is not Precision.FP32 else []
    return " ".join(out)


@dataclasses.dataclass(frozen=True)
class PlanRun:
    """``parallelisms plan``'s configuration: the model, the batch (``train``), the options every plan keeps
    (``base``), the layout flags given (``fixed``, the rest searched), the hardware and how it runs the work
    (:class:`~parallelisms.perf.shapes.Pricing`'s fields), the ``gpus`` to lay out and the ``top`` plans to keep."""

    model: ModelConfig
    train: TrainConfig
    base: ParallelConfig
    fixed: Fixed
    hardware: Hardware
    gpus: int
    top: int = 5
    attention: str = "flash"
    kernels: str = "eager"
    fp8: bool = False


PLAN_FLAGS = (
    Flag("gpus", "GPUs to lay the run out on", parse=integer(1, 2**20), required=True),
    Flag("top", "plans to print (and in --json), best first", parse=integer(1, 1000)),
)
SEARCHED = dict(tp=None, pp=None, cp=None, ep=None, sp=None, zero=None, recompute=None, grad_accum=None,
                mixed_precision="bf16")  # the layout flags' defaults under plan: None is searched


def add_plan_args(p) -> None:
    """plan's own flags; the layout flags it shares default to None (searched) and bf16 mixed precision."""
    add_flags(p, PLAN_FLAGS, PlanRun)
    p.set_defaults(**SEARCHED)


def plan_result(run: PlanRun) -> dict:
    """The plans ``run`` asks for: ``{"plans": [...]}``, best first (the ``--json`` object)."""
    return {"plans": plan(run.model, run.train, run.base, run.hardware, run.gpus, run.fixed, run.attention, run.top,
                          run.fp8, run.kernels)}


def plan_lines(plans: list[dict]) -> list[str]:
    """One line per plan, as the plan verb prints them."""
    return [f"{i + 1}. {p['flags']}: step {p['step_s']:.3f} s, MFU {p['mfu']:.1%}, bubble {p['bubble_fraction']:.3f}, "
            f"{p['memory_per_rank']['total'] / 2**30:.1f} GiB per GPU; bound: {p['reason']}" for i, p in enumerate(plans)]
