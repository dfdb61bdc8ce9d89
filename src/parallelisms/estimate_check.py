"""``parallelisms estimate --check``: the estimate's closed forms beside the dry run of the same layout (the real
code on fake tensors, ``docs/dryrun.md``), memory per rank by kind and bytes per collective per step per mesh
dimension, with the differences.

Memory: the estimate's busiest rank against the rank class whose dry-run peak is highest, split as the dry run
splits it (params, grads, optimizer, buffers: the modules' buffers; activations: every other live storage at the
peak, saved activations, temporaries and communication buffers alike). Collectives: rank 0's, in the training
step (setup left out), summed per (kind, dimension) with the data-parallel flavours of the mesh (dp, dp_cp,
dp_shard, ...) named ``dp`` and the experts' ``ep_bwd`` named ``ep``, as :func:`parallelisms.perf.model.comm_per_step`
names them. The verdict: memory within ``tolerance`` (5%) and every collective's bytes equal.
"""

from __future__ import annotations

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.options import Precision

KINDS = ("params", "grads", "optimizer", "buffers", "activations")
NOT_THE_STEP = ("setup", "report", "eval", "checkpoint")  # as the train report's ledger summary leaves them out
DIM_NAMES = {"dp_cp": "dp", "dp_shard": "dp", "dp_replicate": "dp", "dp_shard_cp": "dp", "ep_bwd": "ep"}


def dim_family(dim: str) -> str:
    return DIM_NAMES.get(dim, dim)


def estimated_collectives(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> dict[str, float]:
    """The estimate's bytes rank 0 sends per step, per ``kind/dimension``."""
    from parallelisms.perf.model import comm_per_step

    out: dict[str, float] = {}
    for v in comm_per_step(cfg, parallel, train, dtype_bytes=2 if parallel.mixed_precision is Precision.BF16 else 4):
        if v.bytes_per_rank:
            key = f"{v.kind}/{dim_family(v.dim)}"
            out[key] = out.get(key, 0.0) + v.bytes_per_rank
    return out


def recorded_collectives(run) -> dict[str, float]:
    """A dry-run rank's bytes sent per step, per ``kind/dimension`` (its first step; setup, the loss's report and
    receives left out, as the train report leaves them out: the estimate counts what a rank sends to train)."""
    out: dict[str, float] = {}
    for e in run.events:
        if e.phase in NOT_THE_STEP or e.kind == "recv" or not e.bytes_per_rank:
            continue
        key = f"{e.kind}/{dim_family(e.dim)}"
        out[key] = out.get(key, 0.0) + e.bytes_per_rank
    return out


def compare(estimated: dict, dry_run: dict, collectives: tuple[dict, dict], tolerance: float = 0.05) -> dict:
    """The ``--check`` object from the estimate's ``memory_per_rank``, the dry run's busiest class (its
    ``memory`` report) and the two collective tables (estimated, recorded)."""
    split = dry_run["split"]
    memory = {k: {"estimate": float(estimated[k]), "dry_run": float(split[k]),
                  "difference": float(estimated[k]) - float(split[k])} for k in KINDS}
    total_e, total_d = float(estimated["total"]), float(dry_run["peak_bytes"])
    memory["total"] = {"estimate": total_e, "dry_run": total_d, "difference": total_e - total_d,
                       "relative": total_e / total_d - 1 if total_d else 0.0}
    comm, comm_ok = compare_collectives(*collectives)
    memory_ok = abs(memory["total"]["relative"]) <= tolerance
    return {"memory": memory, "peak_phase": dry_run.get("peak_phase"), "peak_module": dry_run.get("peak_module"),
            "collectives": comm, "tolerance": tolerance, "memory_ok": memory_ok, "collectives_ok": comm_ok,
            "ok": memory_ok and comm_ok}


def check(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig, estimated_memory: dict,
          tolerance: float = 0.05) -> dict:
    """Dry-run the layout (one rank per class, memory on) and compare it with the estimate's ``memory_per_rank``."""
    from parallelisms.dryrun import dry_run

    result = dry_run(cfg, train, parallel, memory=True)
    busiest = max(result["runs"].values(), key=lambda r: r.memory.get("peak_bytes", 0))
    out = compare(estimated_memory, busiest.memory,
                  (estimated_collectives(cfg, parallel, train), recorded_collectives(result["runs"][0])), tolerance)
    out.update(busiest_rank=busiest.rank, dry_run_seconds=result["seconds"], precheck_ok=result["precheck"]["ok"])
    return out


def check_lines(out: dict) -> list[str]:
    """The text of ``--check``: both sides and the difference, memory by kind and bytes per collective."""
    mib = 2 ** 20
    lines = [f"check against the dry run (rank {out['busiest_rank']}'s class peaks in {out['peak_phase']} at "
             f"{out['peak_module'] or '-'}; dry run {out['dry_run_seconds']:.1f} s):",
             f"  {'memory per rank':<24}{'estimate':>14}{'dry run':>14}{'difference':>14}"]
    for k, v in out["memory"].items():
        rel = f" ({v['relative']:+.1%})" if k == "total" else ""
        lines.append(f"  {k:<24}{v['estimate'] / mib:>10.1f} MiB{v['dry_run'] / mib:>10.1f} MiB"
                     f"{v['difference'] / mib:>+10.1f} MiB{rel}")
    lines.append(f"  {'bytes per step (rank 0)':<24}{'estimate':>14}{'dry run':>14}{'difference':>14}")
    for k, v in out["collectives"].items():
        lines.append(f"  {k:<24}{v['estimate']:>14,.0f}{v['dry_run']:>14,.0f}{v['difference']:>+14,.0f}")
    verdict = "agree" if out["ok"] else "DISAGREE"
    lines.append(f"verdict: {verdict} (memory {'within' if out['memory_ok'] else 'beyond'} "
                 f"{out['tolerance']:.0%}; collectives {'equal' if out['collectives_ok'] else 'differ'})")
    return lines


def compare_collectives(ours: dict, theirs: dict) -> tuple[dict, bool]:
    """Bytes per ``kind/dimension`` side by side (estimate, dry run, difference), and whether every one is equal."""
    comm = {k: {"estimate": ours.get(k, 0.0), "dry_run": theirs.get(k, 0.0),
                "difference": ours.get(k, 0.0) - theirs.get(k, 0.0)} for k in sorted(set(ours) | set(theirs))}
    return comm, all(abs(v["difference"]) <= 1e-9 * max(1.0, v["dry_run"]) for v in comm.values())
