"""Hardware a step is predicted on: presets from datasheets (and, for ``cpu``, this machine measured by
``parallelisms calibrate``), or a JSON file with the same keys.

Required keys: ``name``, ``peak_tflops`` (dense 16-bit; fp32 for ``cpu``), ``hbm_gb``, ``hbm_tbps``,
``gpus_per_node``, ``intra_node_gbps`` and ``inter_node_gbps`` (GB/s per GPU, one direction),
``intra_latency_us``, ``inter_latency_us``. Optional keys describe the GEMM engine (defaults: public cuBLAS
characteristics, NVIDIA's "Matrix multiplication background" guide): ``sustained_tflops`` (the dense 16-bit rate
at the clock the GPU holds under a training load, below the datasheet's boost-clock peak where power caps it:
an H100 SXM at 700 W holds about 1,755 of its 1,980 MHz; 0: the datasheet peak; MFU stays against
``peak_tflops``), ``fp8_tflops`` (dense FP8 at the same clock as ``peak_tflops``; 0: no FP8 tensor cores),
``gemm_fraction`` (the share of peak a
large GEMM reaches), ``gemm_k_half`` (the reduction length at which a GEMM runs at half that: its
prologue/epilogue cost), ``sms`` and ``tile`` (tile and wave quantisation; 0 turns it off), ``hbm_fraction``
(the share of HBM bandwidth an elementwise kernel reaches), ``link_fraction`` (the share of a link's bandwidth
NCCL's bus bandwidth reaches: about 0.8 in nccl-tests on DGX A100/H100), ``bytes_per_element`` (2; 4 for fp32 CPUs), and
``cores`` (CPUs: the cores the ranks share; their operators run where they are dispatched, a rank with more than
one core over its threads: :meth:`Hardware.per_rank`), ``op_overhead_us``
(host time per dispatched operator), ``attention_fraction`` (the share of the GEMM efficiency the attention
kernel reaches; 1: as a GEMM of its shapes, which already prices FlashAttention on GPUs), ``attention_backward``
(its backward's time over its forward's: 2.5 for FlashAttention, whose backward recomputes the scores and runs
four GEMMs where the forward runs two; a CPU kernel's ratio is measured), ``optimizer_tbps`` (the rate the
optimizer step streams its nominal 36 bytes per parameter at; 0: the elementwise bandwidth, as a
fused Adam does) and ``optimizer_tensor_us`` (host time per parameter tensor of an unfused, per-tensor step; 0
for fused/multi-tensor ones), ``comm_cpu_fraction`` (the share of a collective's time the rank's own core
spends on it: CPU comm layers copy through the kernel or shared memory; 0 for NCCL, whose copies run on the
GPU; overlap with compute hides only the rest, and ranks sharing cores share that work too),
``meeting_overhead_us`` (CPUs: the CPU time each blocking collective costs a rank beyond its own work when ranks
outnumber the cores: it sleeps until its peer arrives, another rank runs, and the caches hold that rank's data
when it wakes; ``parallelisms calibrate`` measures it at four ranks per core), ``overlap_overhead_us`` (CPUs: the
CPU time an asynchronous collective, overlapped with compute, costs its rank beyond the same call blocking: the
comm layer's worker thread takes it and shares the rank's core with that compute; 0 for NCCL), ``collectives``:
{kind: {"alpha_us", "gbps"}} measured per collective kind, and ``measurements`` (what ``calibrate`` measured;
not read).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from parallelisms.errors import ConfigError, path_kind, require

REQUIRED = ("name", "peak_tflops", "hbm_gb", "hbm_tbps", "gpus_per_node", "intra_node_gbps", "inter_node_gbps",
            "intra_latency_us", "inter_latency_us")


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float
    hbm_gb: float
    hbm_tbps: float
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    intra_latency_us: float
    inter_latency_us: float
    sustained_tflops: float = 0.0
    fp8_tflops: float = 0.0
    gemm_fraction: float = 0.8
    gemm_k_half: float = 64.0
    sms: int = 108
    tile: int = 128
    hbm_fraction: float = 0.8
    link_fraction: float = 0.8
    bytes_per_element: int = 2
    cores: int = 0          # CPUs: cores the ranks share (beyond them a step is the ranks' CPU work over the cores); 0: a device each
    op_overhead_us: float = 10.0  # host time to dispatch one operator (eager PyTorch; a GPU hides it behind longer kernels)
    attention_fraction: float = 1.0
    attention_backward: float = 2.5  # the attention kernel's backward seconds over its forward's
    optimizer_tbps: float = 0.0
    optimizer_tensor_us: float = 0.0
    comm_cpu_fraction: float = 0.0
    meeting_overhead_us: float = 0.0  # CPUs: CPU time a blocking collective costs a rank beyond its work when ranks outnumber the cores
    overlap_overhead_us: float = 0.0  # CPUs: CPU time an asynchronous collective costs beyond the blocking call (its worker thread)
    collectives: dict = field(default_factory=dict, hash=False)
    measurements: dict = field(default_factory=dict, hash=False, compare=False, repr=False)

    @property
    def kind(self) -> str:
        """``cpu`` where ranks run on ``cores`` (their mechanisms: perf/cpu.py), else ``gpu`` (a device each)."""
        return "cpu" if self.cores else "gpu"

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def gemm_peak_flops(self) -> float:
        """The tensor cores' rate at the sustained clock: what a GEMM's efficiency is a share of."""
        return (self.sustained_tflops or self.peak_tflops) * 1e12

    def fp8(self) -> "Hardware":
        """This GPU's FP8 GEMM engine: ``fp8_tflops`` at the same sustained clock, one byte per element (one line
        where it has none)."""
        require(self.fp8_tflops > 0, f"{self.name} has no FP8 tensor cores (fp8_tflops unset); FP8 compute needs "
                                     f"Hopper or later: --hardware h100 or h200, or a file with fp8_tflops")
        clock = (self.sustained_tflops or self.peak_tflops) / self.peak_tflops
        return replace(self, peak_tflops=self.fp8_tflops, sustained_tflops=self.fp8_tflops * clock, bytes_per_element=1)

    @property
    def memory_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def memory_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12 * self.hbm_fraction

    @property
    def optimizer_bytes_per_s(self) -> float:
        return self.optimizer_tbps * 1e12 if self.optimizer_tbps else self.memory_bytes_per_s

    def ranks_per_core(self, ranks: int) -> float:
        """How many of ``ranks`` processes share each core of a CPU (``cores``); 1 where each has its own (or a
        device)."""
        return ranks / self.cores if self.cores and ranks > self.cores else 1.0

    def per_rank(self, ranks: int) -> "Hardware":
        """One of ``ranks`` processes' share of a CPU with more cores than ranks: the launcher gives each rank
        ``cores // ranks`` intra-op threads, over which its GEMMs, elementwise work, attention and optimizer
        run (the rates are per thread with every core busy, as ``calibrate`` measures them); its operators'
        dispatch does not. Unchanged on a device, or where ranks fill the cores."""
        threads = self.cores // ranks if self.cores else 1
        if threads <= 1:
            return self
        return replace(self, peak_tflops=threads * self.peak_tflops, hbm_tbps=threads * self.hbm_tbps,
                       optimizer_tbps=threads * self.optimizer_tbps)

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """(alpha seconds, bytes per second) of one GPU's link within a node or across nodes."""
        if crosses_nodes:
            return self.inter_latency_us * 1e-6, self.inter_node_gbps * 1e9 * self.link_fraction
        return self.intra_latency_us * 1e-6, self.intra_node_gbps * 1e9 * self.link_fraction

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


PRESETS = {
    # datasheets: A100 SXM 80GB 312 TFLOP/s bf16, 2.0 TB/s, NVLink 300 GB/s per direction, 8 x 200 Gb/s HDR per node
    "a100": Hardware("A100 SXM 80GB", 312, 80, 2.039, 8, 300, 25, 8, 15, sms=108),
    # H100 SXM: 989 TFLOP/s bf16, 3.35 TB/s, NVLink 450 GB/s per direction, 8 x 400 Gb/s per node
    # (1,979 dense FP8); at 700 W the SXM part holds about 1,755 of its 1,980 MHz boost clock under GEMM load
    "h100": Hardware("H100 SXM 80GB", 989, 80, 3.35, 8, 450, 50, 8, 15, sustained_tflops=989 * 1755 / 1980,
                     fp8_tflops=1979, sms=132),
    # torchtitan's Grand Teton H100s: 96 GB of HBM2e at 2.4 TB/s, run at the default 500 W power limit; at 500 W
    # the GEMMs are priced at the H100 SXM's 1,590 MHz base clock (an assumption: no public clock under that cap)
    "h100-500w": Hardware("H100 SXM 96GB HBM2e, 500 W", 989, 96, 2.4, 8, 450, 50, 8, 15,
                          sustained_tflops=989 * 1590 / 1980, fp8_tflops=1979, sms=132),
    "h200": Hardware("H200 141GB", 989, 141, 4.8, 8, 450, 50, 8, 15, sustained_tflops=989 * 1755 / 1980,
                     fp8_tflops=1979, sms=132),
    # this 2-core machine (a KVM Xeon with AVX-512, as re-measured on 2026-12-02), fp32 over gloo/shared memory:
    # `parallelisms calibrate` and the calibrations of `bench predict`, medians, both cores measuring at once as
    # two ranks share them: in the `small` model's own step from no gradients, GEMMs 160-171 GFLOP/s per thread
    # with their cold loads (k_half 8-10 from short-k shapes alone), elementwise 12.0-13.1 GB/s and 2.5-3.8 us
    # per operator (seven sizes from 16 to 1,024 tokens), attention 23.7-25.7% of the GEMM rate and its backward
    # 1.63-1.68x its forward; optimizer with its state cold 7.1-8.9 GB/s + 37-43 us per tensor; collectives
    # 99-100% CPU; alphas: all-reduce 156-177 us (one fit 953), all-gather 118-135, reduce-scatter 132-145,
    # all-to-all 161-184, send 174-210; a blocking collective with four ranks per core, in the model's own tp 2
    # step, 135-275 us of CPU beyond the work; an asynchronous collective behind a burst of GEMMs 178-276 us of CPU
    # beyond the blocking call (median over kinds and sizes). Rerun it on another machine and pass the file.
    "cpu": Hardware("2-core CPU, gloo (calibrated)", 0.163, 16, 0.0122, 1024, 2.9, 2.9, 165, 165,
                    gemm_fraction=1.0, gemm_k_half=9.0, sms=0, tile=0, hbm_fraction=1.0, link_fraction=1.0,
                    bytes_per_element=4, cores=2, op_overhead_us=2.95, attention_fraction=0.24, attention_backward=1.66,
                    optimizer_tbps=0.0075, optimizer_tensor_us=42, comm_cpu_fraction=0.99, meeting_overhead_us=185,
                    overlap_overhead_us=230,
                    collectives={"all_reduce": {"alpha_us": 165, "gbps": 3.3}, "all_gather": {"alpha_us": 127, "gbps": 2.85},
                                 "reduce_scatter": {"alpha_us": 137, "gbps": 1.88},
                                 "all_to_all": {"alpha_us": 170, "gbps": 2.1}, "send": {"alpha_us": 200, "gbps": 3.7}}),
}


ATTENTION_KERNELS = ("flash", "fused-softmax")
# How a GPU runs the non-GEMM work: ``eager``, one kernel per operator as this runtime (and torchtitan without
# torch.compile) dispatches it; ``fused``, the fused kernels of Megatron-LM and Transformer Engine. A CPU runs
# this runtime's eager operators either way.
KERNELS = ("eager", "fused")


def load_hardware(spec: str, flag: str = "--hardware") -> Hardware:
    """A preset name, or a JSON file with the keys in the module docstring (one line naming ``flag`` when it is
    not)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    require(spec.endswith(".json") or path.is_file(),
            f"unknown {flag} {spec!r}; choose one of {', '.join(PRESETS)} or pass a JSON file")
    require(path.is_file(), lambda: f"{flag} {spec!r} {path_kind(path)}; pass a JSON file with keys "
                                    f"{', '.join(REQUIRED)}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{flag} {spec!r} is not a readable JSON file ({exc.__class__.__name__}); "
                          f"write an object with keys {', '.join(REQUIRED)}") from None
    require(isinstance(raw, dict), f"{flag} {spec!r} must hold a JSON object, got {type(raw).__name__}")
    missing = [k for k in REQUIRED if k not in raw]
    require(not missing, f"{flag} {spec!r} lacks {', '.join(missing)}; each of {', '.join(REQUIRED)} is needed")
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(raw) - known)
    require(not unknown, f"{flag} {spec!r}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for key, value in raw.items():
        if key == "name":
            require(isinstance(value, str), f"{flag} {spec!r}: name must be a string, got {value!r}")
        elif key == "measurements":
            continue
        elif key == "collectives":
            require(isinstance(value, dict) and all(isinstance(v, dict) and _positive(v.get("gbps")) and
                                                    _positive(v.get("alpha_us"), zero=True) for v in value.values()),
                    f"{flag} {spec!r}: collectives must map a kind to {{\"alpha_us\", \"gbps\"}} (positive numbers)")
        else:
            zero = key in ("sustained_tflops", "fp8_tflops", "intra_latency_us", "inter_latency_us", "sms", "tile", "gemm_k_half", "cores", "op_overhead_us",
                           "optimizer_tbps", "optimizer_tensor_us", "comm_cpu_fraction", "meeting_overhead_us",
                           "overlap_overhead_us")
            require(_positive(value, zero), f"{flag} {spec!r}: {key} must be a {'non-negative' if zero else 'positive'}"
                                            f" finite number, got {value!r}")
    shares = ("gemm_fraction", "hbm_fraction", "link_fraction", "attention_fraction", "comm_cpu_fraction")
    require(all(raw.get(k, 1) <= 1 for k in shares),
            f"{flag} {spec!r}: {', '.join(shares)} are shares of peak, at most 1")
    ints = {k: int(raw[k]) for k in ("gpus_per_node", "sms", "tile", "bytes_per_element", "cores") if k in raw}
    require(ints.get("gpus_per_node", 1) >= 1, f"{flag} {spec!r}: gpus_per_node must be at least 1")
    return Hardware(**{**raw, **ints})


def _positive(value, zero: bool = False) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return ok and (value >= 0 if zero else value > 0)
