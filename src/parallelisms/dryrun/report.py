"""What ``parallelisms dryrun`` prints: memory per rank class against the hardware's memory, the largest
collectives per group per step, the precheck's verdict; and the ``--json`` object (``rank_classes``,
``memory_per_rank``, ``collectives``, ``precheck``)."""

from __future__ import annotations

from collections import defaultdict

from parallelisms.errors import ConfigError

GIB = 2 ** 30


def dryrun_result(result: dict, hbm_bytes: float | None = None) -> dict:
    """The ``--json`` object of a :func:`parallelisms.dryrun.dry_run` result."""
    runs, classes = result["runs"], result["classes"]
    rank_classes, memory = [], []
    for (pp, cp), members in classes.items():
        run = runs[members[0]]
        rank_classes.append({"pp": pp, "cp": cp, "ranks": len(members), "representative": members[0],
                             "first_ranks": members[:8]})
        memory.append({"class": [pp, cp], "representative": members[0], **run.memory,
                       "fits": None if hbm_bytes is None or not run.memory else run.memory["peak_bytes"] <= hbm_bytes})
    return {"world_size": sum(len(m) for m in classes.values()), "rank_classes": rank_classes,
            "memory_per_rank": memory, "collectives": collectives_per_group(result), "precheck": result["precheck"],
            "hbm_bytes": hbm_bytes, "seconds": result["seconds"]}


def collectives_per_group(result: dict) -> list[dict]:
    """Per mesh dimension and collective kind, in the training step (setup left out), for each rank class's
    representative: calls and bytes sent per rank, and the largest single call."""
    table = defaultdict(lambda: {"calls": 0, "bytes_per_rank": 0.0, "largest_bytes": 0})
    for rank, run in result["runs"].items():
        for e in run.events:
            if e.phase == "setup":
                continue
            row = table[(rank, e.dim, e.kind, len(e.ranks))]
            row["calls"] += 1
            row["bytes_per_rank"] += e.bytes_per_rank
            row["largest_bytes"] = max(row["largest_bytes"], e.numel * _dtype_bytes(e.dtype))
    return [{"rank": rank, "group": dim, "group_size": size, "kind": kind, **row}
            for (rank, dim, kind, size), row in sorted(table.items())]


def _dtype_bytes(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "int64": 8, "bfloat16": 2, "float16": 2, "int32": 4}.get(dtype, 1)


def summary_lines(out: dict, top: int = 8) -> list[str]:
    """The text summary."""
    lines = [f"dry run of {out['world_size']} ranks: {len(out['rank_classes'])} rank class(es) (pipeline stage x "
             f"context-parallel position) run once each, in {out['seconds']:.1f} s"]
    hbm = out["hbm_bytes"]
    for m in out["memory_per_rank"]:
        if not m.get("peak_bytes"):
            continue
        split = ", ".join(f"{k} {v / GIB:.2f}" for k, v in m["split"].items())
        against = f" of {hbm / GIB:.1f} GiB ({'fits' if m['fits'] else 'DOES NOT FIT'})" if hbm else ""
        lines.append(f"  class pp {m['class'][0]} cp {m['class'][1]} (rank {m['representative']}): peak "
                     f"{m['peak_bytes'] / GIB:.2f} GiB{against} in {m['peak_phase']} at {m['peak_module'] or '-'}; "
                     f"{split} GiB")
    largest = sorted(out["collectives"], key=lambda r: -r["bytes_per_rank"])[:top]
    lines.append("largest collectives per step (bytes sent per rank):")
    for r in largest:
        lines.append(f"  rank {r['rank']} {r['kind']} over {r['group']} ({r['group_size']} ranks): {r['calls']} call(s), "
                     f"{r['bytes_per_rank'] / 2 ** 20:.1f} MiB, largest {r['largest_bytes'] / 2 ** 20:.1f} MiB")
    check = out["precheck"]
    verdict = "ok" if check["ok"] else "FAILED: " + "; ".join(check["violations"][:3])
    lines.append(f"collective-order proof: {check['groups']} group(s), {check['collectives']} collective(s), "
                 f"{check['messages']} message(s): {verdict}")
    return lines


def check_fits(out: dict) -> None:
    """One line if a rank class's peak is over the hardware's memory: where the peak is and by how much."""
    hbm = out["hbm_bytes"]
    for m in out["memory_per_rank"]:
        if hbm and m.get("peak_bytes", 0) > hbm:
            raise ConfigError(f"the model does not fit: rank {m['representative']} (pipeline stage {m['class'][0]}) "
                              f"peaks at {m['peak_bytes'] / GIB:.2f} GiB in {m['peak_phase']} at "
                              f"{m['peak_module'] or '-'}, {(m['peak_bytes'] - hbm) / GIB:.2f} GiB over the "
                              f"{hbm / GIB:.1f} GiB per GPU; shard more (--zero, --fsdp, --tp, --pp) or --recompute")
