"""The step model against vTrain's measured single-node runs (Bang et al., MICRO'24, arXiv 2312.12391): 1,440
Megatron-DeepSpeed iteration times of GPT models (hidden 1,024 or 2,048, 16 heads, 12-24 layers, sequences of
1,024) on one node of eight A100 80GB, over every tp x dp x pp of 2, 4 and 8 GPUs.

The runs' settings, as vTrain's repository configures and describes them: GPT-2's vocabulary (50,257, padded by
Megatron to a multiple of 128 x tp), LayerNorm and a GELU MLP of 4h, learned positions, fp16 with Megatron's
fused scale-mask-softmax (no FlashAttention), activation checkpointing of every layer (full recompute),
PyTorch's data parallelism without gradient buckets (one all-reduce after the backward, exposed), 1F1B over
the micro batches (without a pipeline, gradient accumulation over them). Nothing here is fitted to the rows:
each row is predicted by perf/step.py on the ``a100`` preset."""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from pathlib import Path

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.perf.hardware import Hardware
from parallelisms.perf.step import predict_step

GPT2_VOCAB = 50257


@dataclass(frozen=True)
class Run:
    """One measured row."""
    gpus: int
    global_batch: int
    micro_batch: int
    hidden: int
    heads: int
    layers: int
    seq: int
    tp: int
    dp: int
    pp: int
    measured_ms: float

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def params(self) -> int:
        """Parameters of the blocks (12 l h^2): the model size the rows are grouped by."""
        return 12 * self.layers * self.hidden ** 2


def load_runs(path: str | Path) -> list[Run]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    return [Run(*(int(float(v)) for v in row[:-1]), float(row[-1])) for row in rows if row]


def padded_vocab(tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x tp (its make-vocab-size-divisible-by)."""
    unit = 128 * tp
    return -(-GPT2_VOCAB // unit) * unit


def configs(run: Run) -> tuple[ModelConfig, ParallelConfig, TrainConfig]:
    """The model, layout and batch of one row, as the run set them."""
    cfg = ModelConfig(vocab_size=padded_vocab(run.tp), dim=run.hidden, n_layers=run.layers, n_heads=run.heads,
                      n_kv_heads=run.heads, ffn_dim=4 * run.hidden, max_seq_len=run.seq, mlp="gelu")
    m = run.microbatches
    pipeline = dict(schedule="1f1b", microbatches=m) if run.pp > 1 else {}
    parallel = ParallelConfig(ParallelDims(dp_replicate=run.dp, tp=run.tp, pp=run.pp), mixed_precision="bf16",
                              recompute="full", **pipeline)
    train = TrainConfig(global_batch=run.global_batch, seq_len=run.seq, grad_accum=1 if run.pp > 1 else m,
                        bucket_mb=2.0**20)  # no gradient buckets: one all-reduce after the backward
    return cfg, parallel, train


def predict_ms(run: Run, hw: Hardware) -> float:
    cfg, parallel, train = configs(run)
    return predict_step(cfg, parallel, train, hw, attention="fused-softmax", kernels="fused")["step_s"] * 1e3


def errors(runs: list[Run], hw: Hardware) -> list[tuple[Run, float, float]]:
    """(run, predicted ms, signed relative error) of each run."""
    out = []
    for run in runs:
        predicted = predict_ms(run, hw)
        out.append((run, predicted, predicted / run.measured_ms - 1))
    return out


def summary(results: list[tuple[Run, float, float]]) -> dict:
    """Mean absolute and max error, over all runs and by tp, pp, dp, micro batch and model size."""
    def stats(items):
        errs = [abs(e) for _, _, e in items]
        return {"runs": len(errs), "mean_abs_error": statistics.mean(errs), "max_abs_error": max(errs),
                "mean_signed_error": statistics.mean(e for _, _, e in items)}

    groups = {}
    for key, of in (("tp", lambda r: r.tp), ("pp", lambda r: r.pp), ("dp", lambda r: r.dp),
                    ("micro_batch", lambda r: r.micro_batch), ("hidden", lambda r: r.hidden),
                    ("params_M", lambda r: round(r.params / 1e6))):
        values = sorted({of(r) for r, _, _ in results})
        groups[key] = {v: stats([x for x in results if of(x[0]) == v]) for v in values}
    return {**stats(results), "by": groups}
