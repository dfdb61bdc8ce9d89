"""Mutation check of ``parallelisms verify`` (issue: "verify that catches every bug class").

``verify`` claims that a layout which trains differently from single-process training fails. This script
tests that claim the direct way: it plants one known bug at a time in a copy of the source (a *mutant*),
runs ``parallelisms verify`` on a layout that executes the mutated line, once at its defaults (fp32, then float64
where cheap), once with ``--dtype float32`` alone and once with ``--dtype float64``, and records whether verify
noticed (``--dtypes`` picks the columns; a mutant of the checkpoint path runs ``verify-resume`` instead, whose
``--run`` takes the dtype):

* killed   -- verify exited 1 with its JSON verdict (``ok: false``); the figures say which quantity failed
              (loss, gradient norm before clipping, parameters) and by how much (relative difference);
* crashed  -- any other non-zero exit, or a timeout: the bug was noticed, but by an error, not by the check;
* survived -- verify exited 0: the bug went through.

Each mutant is data: a few ``(file under src/parallelisms, old text, new text)`` patches (the old text must
occur exactly once in today's source, or the script stops before running anything), a one-line bug class,
and the verify flags of a small layout that runs it. A mutant that provably cannot change the computed
result is marked ``equivalent=True`` with the argument in ``reason`` and left out of the kill rate. A
control row runs the unmutated source on every layout, so a mutant's failure is its own.

The copy of ``src/`` is put first on ``PYTHONPATH``, which shadows the editable install in verify's process
and in the rank processes it spawns. Runs are sequential (every layout is a multi-process job).

Usage::

    python3 scripts/mutants.py --list                    # the mutants, nothing run
    python3 scripts/mutants.py --only ddp-no-average,ring-lse-merge
    python3 scripts/mutants.py --markdown docs/verify.md # all of them (about an hour on 2 cores)

``--markdown FILE`` writes the results table between the ``<!-- mutants:begin -->`` and
``<!-- mutants:end -->`` lines of FILE (or the whole file when it has no such lines). Not a test: pytest
never collects it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
DTYPES = ("defaults", "float32", "float64")  # defaults: no --dtype (verify: fp32, then float64 where cheap)
RESUME_RUN = "--preset tiny --steps 4 --global-batch 8 --seq-len 32"  # verify-resume's --run, before any --dtype
COLLECTIVE_TIMEOUT_S = 120   # verify --timeout: a mutant that desynchronises collectives fails after this
RUN_TIMEOUT_S = 480          # the whole verify run
BEGIN, END = "<!-- mutants:begin -->", "<!-- mutants:end -->"

# Model configs some layouts need, written to the scratch directory; flags name them as {vocab255}.
CONFIGS = {
    # a vocabulary tp 2 does not divide (padded to 256): the cross-entropy must mask the padded column
    "vocab255": {"vocab_size": 255, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128},
    # tiny with 4 layers: zb-v at pp 2 runs 4 virtual stages
    "layers4": {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128},
}


@dataclass(frozen=True)
class Mutant:
    id: str
    bug: str                                  # the bug class, one line
    flags: str                                # verify flags of a layout that runs the mutated code
    patches: tuple[tuple[str, str, str], ...]  # (file under src/parallelisms, old text, new text)
    equivalent: bool = False                  # proven not to change the computed result
    reason: str = ""                          # the proof (equivalent), or why verify cannot see it
    verb: str = "verify"                      # or verify-resume (flags: its --save-layout and --resume-layout)


def mutant(id, bug, flags, *patches, equivalent=False, reason="", verb="verify"):
    return Mutant(id, bug, flags, tuple(patches), equivalent, reason, verb)


MUTANTS = [
    # -- data parallelism (DDP) ------------------------------------------------------------------------------
    mutant("ddp-no-average", "DDP gradient summed over ranks, not divided by N", "--dp 2",
           ("parallel/data.py", "view, scale = bucket.views[p_index], 1.0 / self.comm.size",
            "view, scale = bucket.views[p_index], 1.0")),
    mutant("ddp-bucket-skipped", "one DDP bucket (the second launched) never all-reduced", "--dp 2 --bucket-mb 0.05",
           ("parallel/data.py", "bucket.pending = bucket.comm.all_reduce(bucket.buffer, async_op=True",
            "bucket.pending = bucket.comm.all_reduce(bucket.buffer if self._next_to_launch != 1 "
            "else bucket.buffer.clone(), async_op=True")),
    mutant("ddp-accum-not-divided", "DDP gradient accumulated under no_sync not divided by N at launch",
           "--dp 2 --grad-accum 2",
           ("parallel/data.py", "bucket.buffer.div_(self.comm.size)", "pass")),
    mutant("cp-grad-avg-dp-only", "replicated weights averaged over dp only, not over dp x cp",
           "--dp 2 --cp 2",
           ("train_setup.py", 'DataParallel(module, comms, "dp_cp"', 'DataParallel(module, comms, "dp"')),
    # -- ZeRO / FSDP flat engine --------------------------------------------------------------------------------
    mutant("zero3-rs-not-averaged", "ZeRO-3 gradient reduce-scatter summed, not averaged", "--zero 3 --dp 2",
           ("parallel/flat.py", "grad32.div_(self.dp_size)", "pass")),
    mutant("zero1-no-allgather", "ZeRO-1 all-gather of updated shards after the step skipped", "--zero 1 --dp 2",
           ("parallel/flat.py", "                _gather_into(unit.comm, src, unit.full.data)\n",
            "                pass\n")),
    mutant("zero2-accum-overwrite", "ZeRO-2 reduced shard of a later microbatch overwrites instead of adding",
           "--zero 2 --dp 2 --grad-accum 2",
           ("parallel/flat.py", "unit.shard.grad.add_(reduced)", "unit.shard.grad.copy_(reduced)")),
    mutant("hsdp-no-replicate-allreduce", "hybrid shard: all-reduce of reduced shards over dp_replicate dropped",
           "--fsdp hybrid_shard --dp-replicate 2 --dp-shard 2",
           ("parallel/flat.py", "unit.replicate.all_reduce(reduced)", "pass")),
    # -- per-parameter FSDP (FSDP2) and buffer reuse (YaFSDP) -----------------------------------------------------
    mutant("fsdp2-accum-overwrite", "per-parameter FSDP: later microbatch's reduce-scatter overwrites the shard grad",
           "--fsdp full_shard --fsdp-style per_param --dp 2 --grad-accum 2",
           ("parallel/fsdp2.py", "unit.grad.add_(out)", "unit.grad.copy_(out)")),
    mutant("fsdp2-rs-not-averaged", "per-parameter FSDP (shard_grad_op): reduce-scatter not divided by N",
           "--fsdp shard_grad_op --fsdp-style per_param --dp 2",
           ("parallel/fsdp2.py", "send = self._grad_send_buffer(unit).div_(self.dp_size)",
            "send = self._grad_send_buffer(unit)")),
    mutant("yafsdp-fresh-buffer-unzeroed", "buffer reuse: a freshly allocated (uninitialised) gradient buffer taken "
           "as zeroed; only reused ones are zeroed", "--fsdp full_shard --fsdp-style reuse --dp 2",
           ("parallel/yafsdp.py", "        buffer = self._buffer(self.grad_buffers, \"grad\", unit)\n",
            "        fresh = self.grad_buffers[self._slot(unit)] is None\n"
            "        buffer = self._buffer(self.grad_buffers, \"grad\", unit)\n"),
           ("parallel/yafsdp.py", "        buffer.zero_()", "        if not fresh:\n            buffer.zero_()")),
    mutant("yafsdp-grad-buffer-stale", "buffer reuse: reused gradient buffer not zeroed before accumulation",
           "--fsdp full_shard --fsdp-style reuse --dp 2",
           ("parallel/yafsdp.py", "buffer.zero_()", "pass")),
    # -- pipeline parallelism ------------------------------------------------------------------------------------
    mutant("pp-loss-not-scaled", "pipeline microbatch loss not divided by the microbatch count",
           "--pp 2 --global-batch 8",
           ("parallel/pipeline/runner.py", "self.loss_scale = 1.0 / schedule.microbatches\n",
            "self.loss_scale = 1.0\n")),
    mutant("pp-dp-sync-dropped", "pipeline stage gradients never all-reduced over dp", "--pp 2 --dp 2 --global-batch 8",
           ("parallel/pipeline/stage_sync.py", "self.engines[stage].reduce_held()", "pass")),
    mutant("zb-w-skipped", "zero-bubble deferred weight gradient (W) never executed",
           "--pp 2 --schedule zb-h1 --global-batch 8",
           ("parallel/pipeline/executor.py", "self.store.flush((a.stage, a.mb))", "pass")),
    mutant("zb-w-twice", "zero-bubble deferred weight gradient (W) executed twice",
           "--config {layers4} --pp 2 --schedule zb-v --global-batch 8",
           ("parallel/pipeline/executor.py", "in self.pending.pop(key, []):", "in self.pending.pop(key, []) * 2:")),
    mutant("dualpipe-copies-not-summed", "DualPipe: the two copies of a stage step with their own gradients only",
           "--pp 2 --schedule dualpipe --global-batch 8",
           ("parallel/pipeline/stage.py", "mine.add_(other)", "pass")),
    mutant("dualpipe-norm-counts-copies", "DualPipe: the second copies' gradients counted in the global norm",
           "--pp 2 --schedule dualpipe --global-batch 8",
           ("parallel/pipeline/stage_sync.py", "            if s not in self.copies:\n                for dims, sq",
            "            if True:\n                for dims, sq")),
    mutant("pp-zero1-no-allgather", "pipeline ZeRO-1: updated shards never all-gathered into the stages",
           "--pp 2 --dp 2 --zero 1 --global-batch 8",
           ("parallel/pipeline/stage_sync.py", "            engine.after_step()", "            pass")),
    mutant("pipedream-stale-stash", "PipeDream: stash taken once per step, later forwards run on stale weights",
           "--pp 2 --schedule pipedream --global-batch 8",
           ("parallel/pipeline/pipedream.py", "if version != a.version:", "if version is None:")),
    mutant("pipedream-loss-scaled", "PipeDream: each update's loss scaled by 1/M (gradient M times too small)",
           "--pp 2 --schedule pipedream --global-batch 8",
           ("parallel/pipeline/runner.py", "self.loss_scale = 1.0  # each update",
            "self.loss_scale = 1.0 / schedule.microbatches  # each update")),
    # -- tensor and sequence parallelism ---------------------------------------------------------------------------
    mutant("tp-input-grad-not-reduced", "column-parallel input gradient not all-reduced (f made identity both ways)",
           "--tp 2",
           ("parallel/tensor.py", "else _Ready(self.comm.all_reduce(grad))", "else _Ready(grad)")),
    mutant("tp-row-output-not-reduced", "row-parallel partial outputs not all-reduced (g made identity both ways)",
           "--tp 2",
           ("parallel/tensor.py", "return region.comm.all_reduce(y)", "return y")),
    mutant("sp-norm-grad-not-reduced", "sequence-parallel norm weight gradients not all-reduced over tp",
           "--tp 2 --sp",
           ("parallel/tensor.py", "return normed.type_as(x) * copy_to_group(self.weight, self.comm)",
            "return normed.type_as(x) * self.weight")),
    mutant("gqa-kv-head-index", "GQA with tp > KV heads: rank takes KV head rank % replicas, not rank // replicas",
           "--tp 4",
           ("parallel/tensor.py", "(self.region.comm.rank // self.replicas) * self.head_rows",
            "(self.region.comm.rank % self.replicas) * self.head_rows")),
    mutant("vocab-embedding-no-mask", "vocab-parallel embedding: tokens of other ranks not zeroed before the sum",
           "--tp 2",
           ("parallel/vocab.py", ".masked_fill(outside.unsqueeze(-1), 0.0)", "")),
    mutant("vocab-embedding-offset", "vocab-parallel embedding: rank r's rows start one token early (offset off by "
           "one); the built-in corpus alone (bytes 10-122) never looks up rank 1's rows at tp 2", "--tp 2",
           ("parallel/vocab.py", "local = tokens - comm.rank * rows", "local = tokens - comm.rank * (rows - 1)")),
    mutant("vocab-ce-fp32", "vocab-parallel cross-entropy computed in float32 whatever the dtype (a precision "
           "error fp32 runs cannot see)", "--tp 2",
           ("parallel/vocab.py", "        logits = upcast(logits)\n", "        logits = logits.float()\n")),
    mutant("vocab-ce-no-pad-mask", "vocab-parallel cross-entropy: padded vocabulary column not masked",
           "--config {vocab255} --tp 2",
           ("parallel/vocab.py", "if start + cols > vocab_size:", "if False:")),
    mutant("vocab-ce-local-max", "vocab-parallel cross-entropy: row max not all-reduced (each rank its own max)",
           "--tp 2",
           ("parallel/vocab.py", "comm.all_reduce(row_max, op=dist.ReduceOp.MAX)", "pass")),
    mutant("vocab-ce-max-summed", "vocab-parallel cross-entropy: row maxima summed instead of maxed", "--tp 2",
           ("parallel/vocab.py", "op=dist.ReduceOp.MAX", "op=dist.ReduceOp.SUM"),
           equivalent=True,
           reason="the max is only a shift for exp: after the all-reduce every rank subtracts the same per-row "
                  "constant (the sum of the maxima), and log-sum-exp minus the target logit, and the softmax the "
                  "backward uses, do not depend on which constant is subtracted; the logits here are O(1), so "
                  "exp neither overflows nor underflows and only rounding changes"),
    # -- context parallelism -----------------------------------------------------------------------------------------
    mutant("ring-lse-merge", "ring attention merges block log-sum-exps by max instead of logaddexp", "--cp 2",
           ("parallel/context.py", "new_lse = torch.logaddexp(lse, block_lse)", "new_lse = torch.maximum(lse, block_lse)")),
    mutant("ring-wrong-direction", "ring passes K/V to the previous rank, labelled as the next one's", "--cp 4",
           ("parallel/context.py", "nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size",
            "prv, nxt = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size")),
    mutant("ring-wrong-direction-cp2", "the same ring mutant at cp 2", "--cp 2",
           ("parallel/context.py", "nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size",
            "prv, nxt = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size"),
           equivalent=True, reason="with two ranks the next and the previous rank are the same rank: the patched "
                                   "line computes the same two numbers"),
    mutant("zigzag-positions-mismatch", "tokens sharded contiguously while ring attention masks by zigzag positions",
           "--cp 2",
           ("parallel/cp_modes.py", 'f"{_CORES}:ring_core", zigzag,', 'f"{_CORES}:ring_core", contiguous,')),
    mutant("zigzag-other-partition", "zigzag holds chunks r and N+r instead of r and 2N-1-r", "--cp 2",
           ("parallel/context.py", "first, second = rank * chunk, (2 * size - 1 - rank) * chunk",
            "first, second = rank * chunk, (size + rank) * chunk"),
           equivalent=True,
           reason="every consumer (the runner's token slice, rotary angles, the ring's key positions of each owner) "
                  "reads positions from this one function, and chunks {r, N+r} still partition the sequence "
                  "exactly once, so every query still attends to exactly the keys at or before it and the cp "
                  "ranks' equal-size losses still average to the mean; only the causal load balance changes"),
    mutant("cp-positions-dropped", "context parallel: rotary angles of positions 0..S/N-1 instead of the held ones",
           "--cp 2",
           ("trainer.py", "loss = self.model(x[:, pos], y[:, pos], positions=pos) * scale",
            "loss = self.model(x[:, pos], y[:, pos]) * scale")),
    mutant("ulysses-wrong-dim", "Ulysses all-to-all splits head_dim instead of the heads",
           "--cp 2 --cp-attention ulysses",
           ("parallel/context.py", "send = x.unflatten(1, (n, -1)).movedim(1, 0)",
            "send = x.unflatten(3, (n, -1)).movedim(3, 0)")),
    mutant("loss-report-dp-only", "reported loss averaged over dp only, not dp x cp (training itself right)",
           "--cp 2",
           ("training.py", "all_reduce(losses.stacked()) / (dims.dp * dims.cp)", "all_reduce(losses.stacked()) / dims.dp")),
    # -- expert parallelism and MoE ------------------------------------------------------------------------------------
    mutant("ep-expert-grad-not-reduced", "expert gradients not reduced over the ranks holding the same experts",
           "--preset tiny-moe --dp 4 --ep 2",
           ("train_setup.py", 'replica_comms = {"ep": comms["ep_replicate"]}', 'replica_comms = {"ep": comms["ep_single"]}')),
    mutant("ep-combine-order", "expert parallel: outputs sent back in grouped order, arrival order not restored",
           "--preset tiny-moe --dp 2 --ep 2",
           ("parallel/expert.py", "restored = unsort(out, order)", "restored = out")),
    mutant("moe-aux-loss-dropped", "MoE load-balancing auxiliary loss dropped", "--preset tiny-moe --dp 2 --ep 2",
           ("model/transformer.py",
            "return loss if aux is None else loss + aux", "return loss"),
           reason="model code: verify's single-process reference builds the same mutated model; killed by "
                  "tests/test_expert_parallel.py::test_the_loss_holds_the_load_balancing_term"),
    mutant("pp-stage-aux-not-backpropagated", "pipeline: a stage without the head drops its layers' load-balancing "
           "term from its backward", "--preset tiny-moe --pp 2 --global-batch 8",
           ("parallel/pipeline/executor.py",
            "outs, grads = ([out, aux], [grad, torch.full_like(aux, self.scale)]) if aux is not None else ([out], [grad])",
            "outs, grads = ([out], [grad])")),
    mutant("moe-capacity-off-by-one", "MoE capacity one assignment short (tiny-moe given capacity_factor 1.0)",
           "--preset tiny-moe --dp 2 --ep 2",
           ("config.py", "max_seq_len=128,\n                            n_experts=8, top_k=2),",
            "max_seq_len=128,\n                            n_experts=8, top_k=2, capacity_factor=1.0),"),
           ("model/moe.py", "keep = (rank_in_expert <= capacity)", "keep = (rank_in_expert < capacity)"),
           reason="model code: verify's single-process reference builds the same mutated model; killed by "
                  "tests/test_expert_parallel.py::test_capacity_keeps_exactly_capacity_assignments"),
    # -- gradient norm, clipping, optimizer, accumulation ------------------------------------------------------------------
    mutant("clip-local-norm", "squared norms not all-reduced over a parameter's innermost shard dimension", "--tp 2",
           ("parallel/common.py", "for dim in dims:", "for dim in dims[:-1]:")),
    mutant("norm-missing-group", "global gradient norm leaves out one group (the replicated norm weights)",
           "--zero 1 --dp 2 --tp 2",
           ("parallel/common.py", "for dims, sq in sorted(groups.items()):", "for dims, sq in sorted(groups.items())[1:]:")),
    mutant("clip-skipped", "plain runner: gradients measured but never clipped", "--dp 2",
           ("trainer.py", "if self.cfg.grad_clip > 0:\n                clip_grad_norm_(", "if False:\n                clip_grad_norm_(")),
    mutant("weight-decay-twice", "weight decay applied twice (coefficient doubled)", "--dp 2",
           ("optim.py", "eps=cfg.eps, weight_decay=cfg.weight_decay)", "eps=cfg.eps, weight_decay=2 * cfg.weight_decay)")),
    # -- checkpoints (verify-resume: save in one layout, resume in another) --------------------------------------------
    mutant("resume-data-position-lost", "resume: the data loader's position not restored (the resumed run trains on "
           "the first batches again)", '--save-layout "--dp 2" --resume-layout "--dp 2 --zero 1"',
           ("training.py", "loader.load_state_dict(resumed.data_state)", "pass"), verb="verify-resume"),
    mutant("grad-accum-not-scaled", "plain runner: microbatch loss not divided by the accumulation count",
           "--dp 2 --grad-accum 2",
           ("trainer.py", "scale = self.weight / len(micro)", "scale = self.weight")),
]


# -- patches -------------------------------------------------------------------------------------------------

def patched_sources(m: Mutant, root: Path) -> dict[Path, str]:
    """The mutated text of every file ``m`` touches under ``root``/parallelisms; exits if an old text does not
    occur exactly once or the result does not compile (a syntax error would pass for a detected bug)."""
    texts: dict[Path, str] = {}
    for file, old, new in m.patches:
        path = root / "parallelisms" / file
        text = texts.get(path, path.read_text())
        count = text.count(old)
        if count != 1:
            sys.exit(f"mutant {m.id}: the old text occurs {count} times in src/parallelisms/{file}, not once:\n{old}")
        texts[path] = text.replace(old, new)
    for path, text in texts.items():
        try:
            compile(text, str(path), "exec")
        except SyntaxError as exc:
            sys.exit(f"mutant {m.id}: the patched {path.name} does not compile: {exc}")
    return texts


# -- running verify ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    status: str   # killed, crashed, survived (a mutant); pass, FAIL (a control); n/a (flags refused)
    detail: str

    def cell(self) -> str:
        return f"{self.status}: {self.detail}" if self.detail else self.status


def run_verify(src: Path, flags: str, dtype: str, config_dir: Path, mutated: bool, verb: str = "verify") -> Outcome:
    """``parallelisms VERB FLAGS --json`` (verify or verify-resume) with ``src`` first on the path; the outcome
    and its figures."""
    args = shlex.split(flags.format(**{name: str(config_dir / f"{name}.json") for name in CONFIGS}))
    given = [] if dtype == "defaults" else ["--dtype", dtype]
    if verb == "verify-resume":
        cmd = [sys.executable, "-m", "parallelisms", verb, *args, "--run",
               shlex.join([*shlex.split(RESUME_RUN), *given, "--timeout", str(COLLECTIVE_TIMEOUT_S)]), "--json"]
    else:
        cmd = [sys.executable, "-m", "parallelisms", verb, *args, *given, "--timeout", str(COLLECTIVE_TIMEOUT_S),
               "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=config_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # own process group: a timeout ends the ranks too
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return Outcome("crashed" if mutated else "FAIL", f"timeout after {RUN_TIMEOUT_S} s")
    lines = out.strip().splitlines()
    result = None
    if lines:
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    if proc.returncode == 2 and result is None:
        return Outcome("n/a", "flags refused: " + last_line(err))
    if result is None or proc.returncode not in (0, 1):
        return Outcome("crashed" if mutated else "FAIL", f"exit {proc.returncode}: {last_line(err)}")
    if proc.returncode == 0:
        return Outcome("survived" if mutated else "pass", f"worst {worst(result):.1e}")
    return Outcome("killed" if mutated else "FAIL", failing(result))


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "no message")[:160]


def figures(result: dict) -> dict[str, float]:
    keys = {"loss": "max_loss_rel_diff", "norm": "max_grad_norm_rel_diff", "param": "max_param_rel_diff"}
    return {name: result[key] for name, key in keys.items() if result.get(key) is not None}


def worst(result: dict) -> float:
    return max(figures(result).values())


def failing(result: dict) -> str:
    """The quantities over the tolerance, with their relative differences (NaN fails too)."""
    if result.get("nonfinite"):
        return f"non-finite ({result['nonfinite']})"
    tol = result["tolerance"]
    bad = [f"{name} {value:.1e}" for name, value in figures(result).items() if not value <= tol]
    if result.get("float64") and not result["float64"]["ok"]:  # a default run's float64 pass
        bad.append("float64 " + failing(result["float64"]))
    return ", ".join(bad)


# -- the table -----------------------------------------------------------------------------------------------

def print_list(mutants: list[Mutant]) -> None:
    for m in mutants:
        files = ", ".join(sorted({f for f, _, _ in m.patches}))
        print(f"{m.id:30} {'(equivalent) ' if m.equivalent else ''}{m.bug}\n{'':30} {files}: {m.verb} {m.flags}")


def summary_lines(mutants: list[Mutant], results: dict, dtypes=DTYPES) -> list[str]:
    counted = [m for m in mutants if not m.equivalent]
    lines = []
    for dtype in dtypes:
        statuses = [results[m.id][dtype].status for m in counted]
        detected = statuses.count("killed") + statuses.count("crashed")
        survivors = [m.id for m in counted if results[m.id][dtype].status == "survived"]
        not_run = [m.id for m in counted if results[m.id][dtype].status == "n/a"]
        ran = len(counted) - len(not_run)
        lines.append(f"{dtype}: {detected}/{ran} non-equivalent mutants detected "
                     f"({detected / max(1, ran):.0%}; {statuses.count('killed')} killed, "
                     f"{statuses.count('crashed')} crashed); survived: {', '.join(survivors) or 'none'}"
                     + (f"; not run (flags refused): {', '.join(not_run)}" if not_run else ""))
    return lines


def markdown(mutants: list[Mutant], results: dict, controls: dict, dtypes=DTYPES) -> str:
    rows = ["| mutant | bug class | layout (verify flags) | " + " | ".join(dtypes) + " |",
            "|---|---|---|" + "---|" * len(dtypes)]
    for m in mutants:
        bug = m.bug + (f" *(equivalent: {m.reason})*" if m.equivalent else f" *({m.reason})*" if m.reason else "")
        verb = "" if m.verb == "verify" else f"{m.verb} "
        rows.append(f"| `{m.id}` | {bug} | `{verb}{m.flags}` | "
                    + " | ".join(results[m.id][d].cell() for d in dtypes) + " |")
    rows += ["", "Control (unmutated source, each layout once):", "",
             "| layout (verify flags) | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes)]
    rows += [f"| `{flags}` | " + " | ".join(out[d].cell() for d in dtypes) + " |" for flags, out in controls.items()]
    rows += [""] + [f"- {line}" for line in summary_lines(mutants, results, dtypes)]
    return "\n".join(rows) + "\n"


def write_markdown(path: Path, table: str) -> None:
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = f"{head}{BEGIN}\n{table}{END}{rest.split(END, 1)[1]}"
    else:
        text = f"{BEGIN}\n{table}{END}\n"
    path.write_text(text)


# -- main ----------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated mutant ids to run")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--markdown", metavar="FILE", help="write the results table to FILE")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="the columns: defaults, float32, float64")
    args = parser.parse_args()
    dtypes = tuple(args.dtypes.split(","))
    if not set(dtypes) <= set(DTYPES):
        sys.exit(f"--dtypes: choose among {', '.join(DTYPES)}")

    ids = [m.id for m in MUTANTS]
    assert len(set(ids)) == len(ids), "duplicate mutant ids"
    mutants = MUTANTS
    if args.only:
        wanted = args.only.split(",")
        unknown = [i for i in wanted if i not in ids]
        if unknown:
            sys.exit(f"unknown mutant id(s): {', '.join(unknown)}; see --list")
        mutants = [m for m in MUTANTS if m.id in wanted]
    for m in mutants:   # every patch must apply to today's source before anything runs
        patched_sources(m, SRC)
    if args.list:
        print_list(mutants)
        return 0

    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        config_dir = Path(tmp)
        for name, config in CONFIGS.items():
            (config_dir / f"{name}.json").write_text(json.dumps(config))

        controls: dict[str, dict[str, Outcome]] = {}
        for flags, verb in dict.fromkeys((m.flags, m.verb) for m in mutants):
            controls[flags] = {dtype: run_verify(SRC, flags, dtype, config_dir, mutated=False, verb=verb)
                               for dtype in dtypes}
            print(f"control  {flags:55} " + "  ".join(f"{d}: {o.cell()}" for d, o in controls[flags].items()),
                  flush=True)

        results: dict[str, dict[str, Outcome]] = {}
        for m in mutants:
            copy = config_dir / m.id / "src"
            shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            for path, text in patched_sources(m, copy).items():
                path.write_text(text)
            results[m.id] = {dtype: run_verify(copy, m.flags, dtype, config_dir, mutated=True, verb=m.verb)
                             for dtype in dtypes}
            shutil.rmtree(copy.parent)
            print(f"{m.id:30} {'(equivalent) ' if m.equivalent else ''}"
                  + "  ".join(f"{d}: {o.cell()}" for d, o in results[m.id].items()), flush=True)

    print()
    for line in summary_lines(mutants, results, dtypes):
        print(line)
    broken = [flags for flags, out in controls.items() if any(o.status != "pass" for o in out.values())]
    for flags in broken:
        print(f"CONTROL FAILED: verify {flags} does not pass unmutated; its mutants' rows mean nothing")
    contradicted = [m.id for m in mutants if m.equivalent
                    and any(results[m.id][d].status != "survived" for d in dtypes)]
    for mid in contradicted:
        print(f"EQUIVALENCE CONTRADICTED: {mid} was detected although marked equivalent")
    if args.markdown:
        write_markdown(Path(args.markdown), markdown(mutants, results, controls, dtypes))
        print(f"table written to {args.markdown}")
    return 1 if broken or contradicted else 0


if __name__ == "__main__":
    sys.exit(main())
