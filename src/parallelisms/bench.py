"""``parallelisms bench NAME``: this project's implementation against the best runnable peer, same run.

Both run in the same processes on the same model, data and settings, alternating in rounds so drift on a
shared machine hits both; each reports the median step time, and ``ratio`` = ours / peer (below 1 is
faster). Every rank uses one thread (two ranks on two cores). Benchmarks are not tests: nothing here
runs in the test suite. Each entry registers itself in ``BENCHES``.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from parallelisms.config import TrainConfig, preset
from parallelisms.errors import ConfigError
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.launch import RankInfo, launch
from parallelisms.model import build_model

BENCHES: dict = {}


def bench(name: str):
    def register(fn):
        BENCHES[name] = fn
        return fn
    return register


# Options only some benchmarks read, with their defaults (None until given: given to another benchmark, they would
# be silently ignored)
PIPELINES = ("pipeline", "pipeline-balance")
ONLY_FOR = {"schedule": (PIPELINES, "1f1b"), "microbatches": (PIPELINES, 0), "sp": (("tp",), False),
            "target": (("tp",), "block"), "hardware": (("predict",), "calibrate"),
            "seq_lens": (("cp",), [1024, 2048, 4096, 8192, 16384])}
# Defaults that differ by benchmark (long sequences take a small batch; experts need an MoE model)
# (predict: twelve steps, so the median is the steady state the model predicts: steps two and three still warm up,
# forwards of 43-56 ms where later ones take 35-37, and of five steps they were half the median's four)
DEFAULTS = {"preset": {"ep": "tiny-moe", "ep-balance": "tiny-moe"}, "global_batch": {"cp": 2}, "rounds": {"predict": 5}, "steps": {"predict": 12}}
GENERAL = {"preset": "small", "global_batch": 8, "rounds": 3, "steps": 5}


def run_bench(args) -> dict:
    if args.name not in BENCHES:
        raise ConfigError(f"unknown benchmark {args.name!r}; choose one of {', '.join(BENCHES)}")
    for name, (benches, default) in ONLY_FOR.items():
        value = getattr(args, name)
        if value is not None and args.name not in benches:
            flag = "--" + name.replace("_", "-")
            shown = ",".join(map(str, value)) if isinstance(value, list) else value
            given = flag if value is True else f"{flag} {shown}"
            raise ConfigError(f"{given} applies to bench {' and '.join(benches)} only, not {args.name}; drop {flag}")
        setattr(args, name, default if value is None else value)
    for name, general in GENERAL.items():
        if getattr(args, name) is None:
            setattr(args, name, DEFAULTS[name].get(args.name, general))
    result = BENCHES[args.name](args)
    print(f"bench {args.name}: ours {result['ours_s'] * 1e3:.1f} ms, {result['peer']} {result['peer_s'] * 1e3:.1f} ms "
          f"per step, ratio {result['ratio']:.3f}" + "".join(f", {k} {v:.3f}" for k, v in result.items()
                                                            if k.endswith("_efficiency")))
    if "alpha_s" in result:  # the fitted model itself
        print(f"alpha {result['alpha_s'] * 1e6:.1f} us per call, beta {result['beta_s_per_byte'] * 1e9:.3f} ns per byte "
              f"({result['bandwidth_GB_per_s']:.2f} GB/s), fit r2 {result['r2']:.3f}")
    return result


class Timings(dict):
    """Median seconds per step by runner name (what :func:`alternate` returns), with ``samples``: every timed
    step's seconds by name, in the order they ran."""

    def __init__(self, medians: dict, samples: dict):
        super().__init__(medians)
        self.samples = samples

    def per_round(self, name, rounds: int) -> list[float]:
        """``name``'s steps cut into ``rounds`` consecutive groups, the median of each."""
        steps = self.samples[name]
        size = max(1, len(steps) // rounds)
        return [statistics.median(steps[i:i + size]) for i in range(0, size * rounds, size) if steps[i:i + size]]


def alternate(runs: dict, steps: int, rounds: int) -> Timings:
    """Time ``steps`` calls of each runner per round, alternating over ``rounds``; median per-step seconds.
    One untimed warm-up step each first."""
    times = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            for _ in range(steps):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return Timings({name: statistics.median(t) for name, t in times.items()}, times)


def round_ratios(times: Timings, ours, peer, rounds: int) -> list[float]:
    """``ours`` over ``peer`` in each of ``rounds`` rounds (medians per round): the spread of the headline
    ratio, whose value is the ratio of the medians over every round."""
    return ratios(times.per_round(ours, rounds), times.per_round(peer, rounds))


def ratios(ours: list[float], peer: list[float]) -> list[float]:
    """Round by round, ours over the peer's."""
    return [o / p for o, p in zip(ours, peer)]


def scaling(single_s: float, world: int, ours_s: float, peer_s: float) -> dict:
    """One process's step time on the same global batch, and ours' and the peer's scaling efficiency against
    it: single / (world x step)."""
    return {"single_process_s": single_s, "ours_scaling_efficiency": single_s / (world * ours_s),
            "peer_scaling_efficiency": single_s / (world * peer_s)}


def _allocations(prof) -> tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]:
    """(time, bytes, address) of every allocator event, and the (start, end) of each ``record_function``
    region."""
    from torch._C._profiler import _EventType

    events, regions, stack = [], {}, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
        elif node.name.startswith("bench_"):
            regions[node.name] = (node.start_time_ns, node.end_time_ns)
    return sorted(events), regions


def profiled(build) -> tuple[object, dict]:
    """Build an implementation (``build()`` returns its step function) and run two steps under the allocator
    profiler; returns the step function and its memory figures."""
    gc.collect()
    with _allocator_profile() as prof:
        step = build()
        gc.collect()  # the full model's tensors freed by wrapping may sit in reference cycles
        for name in ("bench_step1", "bench_step2"):
            with _region(name):
                step()
    events, regions = _allocations(prof)
    peak, allocations = _live_peak(events, regions["bench_step1"][0], regions["bench_step2"])
    return step, {"peak_bytes": peak, "allocations_per_step": allocations}


def transient_peak(run) -> int:
    """The most bytes ``run()`` holds at once beyond what was allocated before it (activations, temporaries),
    from the allocator's events."""
    gc.collect()
    with _allocator_profile() as prof:
        with _region("bench_run"):
            run()
    events, regions = _allocations(prof)
    return _live_peak(events, regions["bench_run"][0], regions["bench_run"])[0]


def _allocator_profile():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def _region(name: str):
    from torch.profiler import record_function

    return record_function(name)


def _live_peak(events, start: int, counted: tuple[int, int]) -> tuple[int, int]:
    """(the highest live total from ``start`` on, the allocator calls within ``counted``), counting only blocks
    allocated inside the profile: frees of earlier blocks (another implementation's garbage) are ignored, and
    a block freed unseen (on a comm thread) counts as freed when its address is handed out again."""
    live, peak, allocations, mine = 0, None, 0, {}
    for t, size, ptr in events:
        if size > 0:
            live -= mine.pop(ptr, 0)
            mine[ptr] = size
        elif mine.pop(ptr, None) is None:
            continue
        live += size
        if t >= start:
            peak = live if peak is None else max(peak, live)
        if counted[0] <= t <= counted[1] and size > 0:
            allocations += 1
    return peak or 0, allocations


def plain_step(model, optimizer, batch, zero_grad=None, after_backward=None):
    """One training step on ``batch`` (inputs, targets): zero the gradients (``zero_grad``, a gradient sync's
    own, else the optimizer's), forward, backward, ``after_backward()`` if given, optimizer step."""
    def step():
        (zero_grad or optimizer.zero_grad)()
        model(*batch).backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
    return step


def single_process_step_time(model_cfg, train_cfg: TrainConfig, steps: int) -> float:
    """Median step time of plain training on the whole global batch in one process, one thread."""
    torch.set_num_threads(1)
    model = build_model(model_cfg, train_cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr)
    batch = BatchLoader(load_corpus(), train_cfg.global_batch, train_cfg.seq_len).batch(0)
    return alternate({"single": plain_step(model, opt, batch)}, steps, 1)["single"]


def phase_timed(step, modules, optimizer):
    """``step`` timed by phase on this rank: (timed step, phase name -> seconds per step, for
    :func:`phase_medians`). Forward: the forward calls of ``modules`` (hooks, so a pipeline's many calls
    count too); optimizer: ``optimizer.step`` (hooks); backward: the rest of the step, the gradient sync's and
    a schedule's waits included."""
    seconds = {"forward_s": [], "backward_s": [], "optimizer_s": []}
    spent, started = {"forward_s": 0.0, "optimizer_s": 0.0}, {}

    def hooks(key):
        def before(*_):
            started[key] = time.perf_counter()

        def after(*_):
            spent[key] += time.perf_counter() - started[key]
        return before, after
    for module in modules:
        before, after = hooks("forward_s")
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
    before, after = hooks("optimizer_s")
    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)

    def timed():
        spent.update(forward_s=0.0, optimizer_s=0.0)
        start = time.perf_counter()
        step()
        total = time.perf_counter() - start
        for key in spent:
            seconds[key].append(spent[key])
        seconds["backward_s"].append(total - spent["forward_s"] - spent["optimizer_s"])
    return timed, seconds


def phase_medians(seconds: dict | None, step_s: float, alone_s: float, skip: int = 1) -> dict:
    """Median seconds per phase (the first ``skip`` steps left out: warm-up) and the exposed communication: the
    step's time beyond the same step with no communication at all, on the same ranks in the same rounds.
    ``seconds`` None (an implementation whose phases are not seen): the exposed communication alone."""
    medians = {k: statistics.median(v[skip:]) for k, v in seconds.items()} if seconds else {}
    return {**medians, "exposed_comm_s": max(0.0, step_s - alone_s)}


def _ddp_rank(info: RankInfo, model_cfg, train_cfg: TrainConfig, steps: int, rounds: int):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from parallelisms.comm import Comms
    from parallelisms.mesh import ParallelDims
    from parallelisms.parallel.data import DataParallel

    meshes = ParallelDims(dp_replicate=info.world_size).build_meshes()
    comms = Comms(meshes)
    batch = BatchLoader(load_corpus(), train_cfg.global_batch, train_cfg.seq_len).shard(0, info.rank, info.world_size)

    def runner(model, zero_grad=None, after_backward=None):
        optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr)
        return phase_timed(plain_step(model, optimizer, batch, zero_grad, after_backward), [model], optimizer)
    ours_model = build_model(model_cfg, train_cfg.seed)
    ours = DataParallel(ours_model, comms, "dp", bucket_cap_mb=train_cfg.bucket_mb)
    peer_model = TorchDDP(build_model(model_cfg, train_cfg.seed), bucket_cap_mb=train_cfg.bucket_mb,
                          gradient_as_bucket_view=True)
    one = torch.zeros(1)
    runners = {"peer": runner(peer_model), "ours": runner(ours_model, ours.zero_grad),
               "alone": runner(build_model(model_cfg, train_cfg.seed)),  # no gradient sync at all: the floor
               # the ranks meet once after backward, as every synchronous data parallelism must: the floor plus
               # the wait for the later rank (and one tiny all-reduce)
               "meet": runner(build_model(model_cfg, train_cfg.seed), after_backward=lambda: comms["dp"].all_reduce(one))}
    times = alternate({name: step for name, (step, _) in runners.items()}, steps, rounds)
    phases = {name: phase_medians(seconds, times[name], times["alone"]) for name, (_, seconds) in runners.items()}
    return times, phases, "shared memory" if comms["dp"]._shm else "gloo"


@bench("ddp")
def bench_ddp(args) -> dict:
    """Our DataParallel against torch DistributedDataParallel (gradient_as_bucket_view, same bucket cap). Ours
    all-reduces through the comm layer: shared memory between ranks of one host unless PARALLELISMS_SHM=0.
    ``floor_ratio``: the same step with no gradient sync at all, on the same ranks in the same rounds, over
    the peer's: the lowest ratio any data parallelism could reach here (communication free). ``meet_ratio``:
    that step with the ranks meeting once after backward (a one-element all-reduce), over the peer's: what a
    synchronous data parallelism whose gradient reduction cost nothing would still pay, the wait for the
    later rank."""
    model_cfg = preset(args.preset).validate()
    train_cfg = TrainConfig(global_batch=args.global_batch, seq_len=args.seq_len, bucket_mb=args.bucket_mb)
    train_cfg.validate(model_cfg, dp=args.world)
    times, phases, transport = launch(_ddp_rank, args.world, model_cfg, train_cfg, args.steps, args.rounds,
                                      backend="gloo", threads=1)[0]
    single = single_process_step_time(model_cfg, train_cfg, args.steps)
    return {"bench": "ddp", "world_size": args.world, "params": model_cfg.num_params(),
            "ours_s": times["ours"], "peer": "torch.nn.parallel.DistributedDataParallel", "peer_s": times["peer"],
            "ratio": times["ours"] / times["peer"], "ratio_rounds": round_ratios(times, "ours", "peer", args.rounds),
            "alone_s": times["alone"],
            "floor_ratio": times["alone"] / times["peer"], "meet_s": times["meet"],
            "meet_ratio": times["meet"] / times["peer"], "phases": phases,
            **scaling(single, args.world, times["ours"], times["peer"]),
            "ours_all_reduce_transport": transport}  # PARALLELISMS_SHM=0: gloo, like the peer


def _all_reduce_rank(info: RankInfo, sizes: list[int], repeats: int, pieces: int):
    from parallelisms.comm import Comms
    from parallelisms.mesh import ParallelDims

    comm = Comms(ParallelDims(dp_replicate=info.world_size).build_meshes())["dp"]
    buffers = {numel: torch.ones(numel) for numel in sizes}
    for buf in buffers.values():  # warm every size up before timing any
        comm.all_reduce(buf)
    timings = alternate({numel: (lambda b=buf: comm.all_reduce(b)) for numel, buf in buffers.items()}, repeats, 5)
    total = sizes[-1]
    small = [torch.ones(total // pieces) for _ in range(pieces)]

    def unfused():  # one after another, as the model's K alpha + beta M assumes
        for t in small:
            comm.all_reduce(t)
    fused = torch.ones(total)
    both = alternate({"unfused": unfused, "fused": lambda: comm.all_reduce(fused)}, repeats, 3)
    return timings, both


@bench("alpha-beta")
def bench_alpha_beta(args) -> dict:
    """Fit the Hockney model to this machine's all-reduce, then test its bucketing prediction: K small
    all-reduces against one fused all-reduce of the same total bytes."""
    from parallelisms.comm.ledger import ring_bytes_per_rank
    from parallelisms.perf.collectives import fit

    sizes = [2**k for k in range(8, 23, 2)]  # 1 KiB .. 16 MiB of fp32
    pieces = 64
    timings, both = launch(_all_reduce_rank, args.world, sizes, args.steps, pieces, backend="gloo", threads=1)[0]
    sent = [ring_bytes_per_rank("all_reduce", 4 * n, args.world) for n in sizes]
    model, r2 = fit(sent, [timings[n] for n in sizes])
    total_bytes = 4 * sizes[-1]
    predicted = {name: model.collective_time("all_reduce", total_bytes, args.world, calls)
                 for name, calls in (("unfused", pieces), ("fused", 1))}
    return {"bench": "alpha-beta", "world_size": args.world, "alpha_s": model.alpha_s,
            "beta_s_per_byte": model.beta_s_per_byte, "bandwidth_GB_per_s": model.bandwidth_bytes_per_s / 1e9,
            "r2": r2, "sizes_bytes": [4 * n for n in sizes], "seconds": [timings[n] for n in sizes],
            "bucketing": {"pieces": pieces, "total_bytes": total_bytes, "measured_unfused_s": both["unfused"],
                          "measured_fused_s": both["fused"], "predicted_unfused_s": predicted["unfused"],
                          "predicted_fused_s": predicted["fused"]},
            # the common keys of every entry: ours = the model's prediction, peer = the measurement
            "ours_s": predicted["unfused"], "peer": "measured unfused all-reduces", "peer_s": both["unfused"],
            "ratio": predicted["unfused"] / both["unfused"]}


import parallelisms.benches  # noqa: E402,F401  (registers the other entries)
