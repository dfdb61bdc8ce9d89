"""What ``parallelisms train`` prints at the end: a few readable lines (what ran and on what, the loss, the speed,
the communication and how much of it was exposed, where the trace is) and one line on what to try next.
Numbers are shown at a size people read (``1.2 M`` parameters, ``180.7 kB``), never ``0.00 B``."""

from __future__ import annotations

import sys
from pathlib import Path

from parallelisms.device import Placement
from parallelisms.units import size

# options of train that do not change the layout: left out of the commands suggested next
_NOT_LAYOUT = {"command", "func", "json", "trace", "steps", "device", "tolerance", "dp_default", "slow_rank"}


def layout_flags(args, defaults: dict) -> str:
    """The flags of ``args`` that shape the layout and model and differ from ``defaults`` (for suggestions)."""
    flags = []
    for name, value in vars(args).items():
        if name in _NOT_LAYOUT or name not in defaults or value == defaults[name]:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, tuple):  # --betas B1,B2
            value = ",".join(f"{v:g}" for v in value)
        flags.append(flag if value is True else f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return " ".join(flags)


def next_step(report: dict, args, defaults: dict) -> str:
    """One suggestion: see the timeline when there is none, else check the layout against single-process training
    (``defaults``: verify's parsed defaults, to name only the flags that differ)."""
    flags = layout_flags(args, defaults)
    if not report.get("trace"):
        return (f"next: see when each rank computes and communicates: parallelisms train {flags} --trace trace.json, "
                f"then parallelisms plot-trace trace.json --out trace.png").replace("  ", " ")
    return f"next: check {report['layout']} against single-process training: parallelisms verify {flags}".rstrip()


def _steps(report: dict) -> str:
    """The steps this run trained: all of them, or those after the step it resumed from."""
    resumed = report.get("resumed_from")
    if not resumed:
        return f"{report['steps']} steps"
    done = report["steps"] - resumed["step"]
    return (f"{done} step{'s' if done > 1 else ''} ({resumed['step'] + 1} to {report['steps']}, resumed from step "
            f"{resumed['step']} of {resumed['checkpoint']})")


def print_train_summary(report: dict, args, defaults: dict, out=None) -> None:
    """The end of ``train``: see the module docstring (``defaults`` as :func:`next_step`)."""
    out = out or sys.stdout
    world = report["world_size"]
    model = getattr(args, "init_from", None) or args.config or args.preset
    lines = [
        f"ran:   {report['layout']} on {world} rank{'s' if world > 1 else ''}, "
        f"{Placement(report['device'], report['backend']).describe()}; model {model}, {_steps(report)} of "
        f"{args.global_batch} x {args.seq_len} tokens",
        f"loss:  {report['loss_first']:.4f} -> {report['loss_last']:.4f} (the mean over the data-parallel ranks, as "
        f"the progress bar shows it)" + "".join(
            f"; validation {loss:.4f} at step {step}" for step, loss in report.get("eval_losses", [])[-1:]),
        f"speed: {report['step_time_s'] * 1e3:.1f} ms per step (median), {report['tokens_per_s']:,.0f} tokens/s",
    ]
    comm = ", ".join(f"{k} {v['calls']:g} calls {size(v['bytes_per_rank'])}" for k, v in report["comm"].items())
    predicted = ", ".join(f"{k} {size(v)}" for k, v in report.get("predicted_comm", {}).items())
    lines.append(f"comm:  per step per rank {comm or 'none'}" + (f" (formulas: {predicted})" if predicted else "")
                 + f"; exposed {report['exposed_comm_fraction']:.1%} of the step")
    if "pipeline" in report:
        pipe = report["pipeline"]
        lines.append(f"pipe:  {pipe['schedule']} pp {pipe['pp']} x {pipe['microbatches']} microbatches: measured bubble "
                     f"{pipe['measured_bubble_rate']:.3f}, simulated {pipe['simulated_bubble_rate']:.3f} from measured "
                     f"t_f {pipe['t_f_s'] * 1e3:.2f} t_b {pipe['t_b_s'] * 1e3:.2f} t_w {pipe['t_w_s'] * 1e3:.2f} ms per "
                     f"rank, {pipe['simulated_bubble_rate_with_comm']:.3f} with t_comm {pipe['t_comm_s'] * 1e3:.2f} ms"
                     + (f", {pipe['simulated_bubble_rate_in_run']:.3f} with the run's latency "
                        f"{pipe['t_latency_in_run_s'] * 1e3:.2f} ms and host time {pipe['t_host_s'] * 1e3:.2f} ms"
                        if pipe.get("simulated_bubble_rate_in_run") is not None else ""))
    if report.get("checkpoints"):
        saved = report["checkpoints"]
        lines.append(f"saved: {len(saved)} checkpoint{'s' if len(saved) > 1 else ''}: "
                     + (", ".join(saved) if len(saved) <= 3 else f"{saved[0]}, ..., {saved[-1]}"))
    if report.get("metrics"):
        lines.append(f"log:   {report['metrics']} (one JSON line per step)")
    if "dp_balance" in report:
        balance = report["dp_balance"]
        lines.append(f"balance: sequences per data-parallel rank {balance['split']} (measured speed"
                     + (f", re-split every {balance['every']} steps" if balance["every"] else "") + ")")
    if "expert_load" in report:
        load, ep = report["expert_load"], report.get("stragglers", {}).get("dims", {}).get("ep")
        lines.append(f"experts: tokens per ep rank a step {[round(t) for t in load['tokens_per_ep_rank']]}, max/mean "
                     f"{load['ep_rank_imbalance']:.2f} (per expert {load['expert_imbalance']:.2f}); dropped by capacity "
                     f"{load['dropped_fraction']:.1%}" + (f"; all-to-all wait for the most loaded "
                                                         f"{ep['wait_s_per_step'] * 1e3:.1f} ms a step" if ep else ""))
    if "ep_balance" in report:
        placed = report["ep_balance"]
        lines.append(f"expert placement: measured after steps {placed['measured_after_steps']}, "
                     f"{placed['redundant']} redundant slot(s) per ep rank; last measured ep-rank load max/mean "
                     f"{placed.get('rank_imbalance_before', 1.0):.2f} before, {placed.get('rank_imbalance_after', 1.0):.2f} "
                     f"after; layer 0 slots {placed['placements'][0]}")
    if report.get("stragglers"):
        from parallelisms.stragglers import describe

        lines.extend(describe(report["stragglers"]))
    if report.get("trace"):
        from parallelisms.comm.trace import format_summary

        lines.append(format_summary(report["overlap_per_rank"]))
        picture = str(Path(report["trace"]).with_suffix(".png"))
        lines.append(f"trace: {report['trace']} (open in https://ui.perfetto.dev, or draw it: parallelisms plot-trace "
                     f"{report['trace']} --out {picture})")
    lines.append(next_step(report, args, defaults))
    print("\n".join(lines), file=out)
