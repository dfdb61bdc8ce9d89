"""Held-out published H100 runs whose layouts are given as text: NVIDIA NeMo Framework's performance summaries
(Megatron-Core and Transformer Engine, FP8 linears, DGX H100 at 700 W), priced as each recipe ran: fused
kernels, `--fp8`, the distributed optimizer (ZeRO-1) with its gradient reduce-scatter overlapped with the last
backward and, without a pipeline, the parameter all-gather with the next forward; sequence parallelism wherever
tp > 1 with the backward's collectives overlapped, and Transformer Engine's userbuffers overlap
(``ub_tp_comm_overlap``) as the forward's collectives pipelined in tp chunks; interleaved 1F1B with the table's
virtual stages; the recompute the recipe sets (NeMo-Framework-Launcher's launcher_scripts/conf/training/*.yaml).
Nothing in perf/ was tuned on these rows; each compares tokens per second per GPU, the unambiguous column."""

import pytest

from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.mesh import ParallelDims
from parallelisms.options import FsdpStrategy
from parallelisms.perf.hardware import PRESETS as HARDWARE
from parallelisms.perf.step import predict_step

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)


def _gpt(layers, hidden, heads, vocab=50304, kv=0):
    """GPT-3 and Nemotron-4 shapes: a two-matrix MLP of 4h (GELU; Nemotron's squared ReLU has the same GEMMs)."""
    return ModelConfig(vocab_size=vocab, dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv or heads,
                       ffn_dim=4 * hidden, max_seq_len=8192, mlp="gelu")


def _llama(layers, hidden, heads, kv, ffn, vocab=32000):
    return ModelConfig(vocab_size=vocab, dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                       max_seq_len=8192)


MODELS = {
    "gpt3-5b": _gpt(24, 4096, 32), "gpt3-20b": _gpt(44, 6144, 48), "gpt3-175b": _gpt(96, 12288, 96),
    "llama2-7b": _llama(32, 4096, 32, 32, 11008), "llama2-13b": _llama(40, 5120, 40, 40, 13824),
    "llama2-70b": _llama(80, 8192, 64, 8, 28672),
    "nemotron-8b": _gpt(32, 4096, 32, 256000), "nemotron-22b": _gpt(40, 6144, 48, 256000),
    "nemotron-340b": _gpt(96, 18432, 96, 256000, kv=8),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 128256), "llama3-70b": _llama(80, 8192, 64, 8, 28672, 128256),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, 128256),
}

# Sources: NeMo 24.07, github.com/NVIDIA/NeMo docs/source/performance/performance_summary.md ("Pretraining", FP8,
# DGX-H100); NeMo 25.02, docs.nvidia.com/nemo-framework/user-guide/latest/performance/performance_summary.html
# (DGX-H100); Megatron-Bridge 25.09, github.com/NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (DGX-H100).
# (name, model, GPUs, global batch, micro batch, sequence, tp, pp, cp, vp, recompute, userbuffers, tokens/s/GPU)
ROWS = [
    ("NeMo 24.07 GPT3-5B", "gpt3-5b", 64, 2048, 4, 2048, 1, 1, 1, 1, "none", False, 23406),
    ("NeMo 24.07 GPT3-20B", "gpt3-20b", 64, 256, 2, 2048, 2, 1, 1, 1, "none", True, 5851),
    ("NeMo 24.07 GPT3-175B, 128 GPUs", "gpt3-175b", 128, 256, 1, 2048, 4, 8, 1, 6, "none", False, 716),
    ("NeMo 24.07 GPT3-175B, 512 GPUs", "gpt3-175b", 512, 2048, 2, 2048, 4, 8, 1, 6, "none", False, 825),
    ("NeMo 25.02 GPT3-175B, 512 GPUs", "gpt3-175b", 512, 2048, 2, 2048, 4, 8, 1, 6, "none", False, 866),
    ("NeMo 24.07 Llama 2 7B", "llama2-7b", 8, 128, 1, 4096, 1, 1, 1, 1, "none", False, 16934),
    ("NeMo 24.07 Llama 2 13B", "llama2-13b", 16, 128, 1, 4096, 1, 4, 1, 10, "none", False, 8715),
    ("NeMo 24.07 Llama 2 70B", "llama2-70b", 64, 128, 1, 4096, 4, 4, 1, 20, "none", True, 1728),
    ("NeMo 24.07 Nemotron-8B", "nemotron-8b", 64, 256, 4, 4096, 2, 1, 1, 1, "none", True, 12507),
    ("NeMo 24.07 Nemotron-22B", "nemotron-22b", 64, 256, 2, 4096, 2, 4, 1, 10, "none", True, 4312),
    ("NeMo 24.07 Nemotron-340B", "nemotron-340b", 128, 32, 1, 4096, 8, 8, 1, 12, "selective", True, 326),
    ("NeMo 24.07 Llama 3 8B", "llama3-8b", 8, 128, 1, 8192, 1, 1, 2, 1, "none", False, 12273),
    ("NeMo 24.07 Llama 3 70B", "llama3-70b", 64, 128, 1, 8192, 4, 4, 2, 5, "none", True, 1524),
    ("Megatron-Bridge 25.09 Llama 3 70B", "llama3-70b", 64, 128, 1, 8192, 4, 8, 1, 5, "none", True, 1619),
    ("Megatron-Bridge 25.09 Llama 3.1 405B", "llama3-405b", 1024, 512, 1, 8192, 8, 8, 2, 8, "none", True, 302),
]
# Rows priced more than 10% fast, the mechanism not located (docs/performance-model.md, "Held-out published
# H100 runs"): each runs its linears at tp 1 or 2 on a model of hidden 4,096-6,144, where FP8 GEMMs are the
# largest share of the step, while the rows of 70B and more at tp 4-8 agree; and GPT-3 175B at one sequence a
# microbatch (128 GPUs) is measured below the same layout at two (512 GPUs), which the model prices alike. What
# public figures rule out (a lower sustained FP8 GEMM rate, Transformer Engine's casts, the unfused loss) is in
# that section, and the same Llama 3 8B on the same eight GPUs under Megatron-Bridge 25.09 (the last test) is
# priced within 10%.
UNLOCATED = {
    "NeMo 24.07 GPT3-5B": "tp 1, FP8 linears, hidden 4,096: priced more than 10% fast",
    "NeMo 24.07 GPT3-175B, 128 GPUs": "one sequence a microbatch: priced more than 10% fast",
    "NeMo 24.07 Llama 2 7B": "tp 1, FP8 linears, hidden 4,096: priced more than 10% fast",
    "NeMo 24.07 Llama 2 13B": "tp 1, FP8 linears, hidden 5,120: priced more than 10% fast",
    "NeMo 24.07 Nemotron-8B": "tp 2, FP8 linears, hidden 4,096: priced more than 10% fast",
    "NeMo 24.07 Nemotron-22B": "tp 2, FP8 linears, hidden 6,144: priced more than 10% fast",
    "NeMo 24.07 Llama 3 8B": "tp 1 x cp 2, FP8 linears, hidden 4,096: priced more than 10% fast (at cp 1 under "
                             "Megatron-Bridge 25.09, within 1%)",
}


def tokens_per_gpu_s(row) -> float:
    """The row's predicted tokens per second per GPU on the `h100` preset, priced as the recipe ran."""
    _, model, gpus, batch, micro, seq, tp, pp, cp, vp, recompute, userbuffers, _ = row
    dp = gpus // (tp * pp * cp)
    microbatches = batch // (dp * micro)
    options = dict(sequence_parallel=tp > 1, tp_overlap=tp > 1, tp_overlap_chunks=tp if userbuffers else 0, zero=1,
                   overlap_param_gather=pp == 1, mixed_precision="bf16", recompute=recompute)
    if pp > 1:
        options.update(schedule="interleaved" if vp > 1 else "1f1b", chunks=vp, microbatches=microbatches)
    parallel = ParallelConfig(ParallelDims(dp_shard=dp, tp=tp, pp=pp, cp=cp), **options)
    train = TrainConfig(global_batch=batch, seq_len=seq, grad_accum=1 if pp > 1 else microbatches)
    step = predict_step(MODELS[model], parallel, train, HARDWARE["h100"], kernels="fused", fp8=True)["step_s"]
    return batch * seq / step / gpus


def _marked(row):
    reason = UNLOCATED.get(row[0])
    return pytest.param(row, id=row[0], marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [])


@pytest.mark.parametrize("row", [_marked(row) for row in ROWS])
def test_nemo_h100_row_within_10_percent(row):
    assert tokens_per_gpu_s(row) == pytest.approx(row[-1], rel=0.10)


def test_nemo_h100_rows_mean_error_within_10_percent():
    """Issue 37's goal on held-out published runs: a mean absolute error within 10% over every row."""
    errors = [abs(tokens_per_gpu_s(row) / row[-1] - 1) for row in ROWS]
    assert sum(errors) / len(errors) < 0.10


def test_megatron_bridge_llama3_8b_within_10_percent():
    """The NeMo 24.07 Llama 3 8B row's model on the same eight H100s under Megatron-Bridge 25.09 (its performance
    summary, DGX-H100: global batch 128, one sequence of 8,192 a microbatch, tp 1, cp 1, Megatron-FSDP over the
    eight GPUs, FP8 with current scaling, as scripts/performance/configs/llama3/llama3_8b_llm_pretrain.py sets the
    H100 FP8 recipe): 14,079 tokens/s/GPU, where NeMo 24.07 ran the model at cp 2 and measured 12,273. Held out as
    the rows above are, and outside their mean."""
    parallel = ParallelConfig(ParallelDims(dp_shard=8), fsdp=FsdpStrategy.FULL_SHARD, mixed_precision="bf16")
    train = TrainConfig(global_batch=128, seq_len=8192, grad_accum=16)
    step = predict_step(MODELS["llama3-8b"], parallel, train, HARDWARE["h100"], kernels="fused", fp8=True)["step_s"]
    assert 128 * 8192 / step / 8 == pytest.approx(14079, rel=0.10)
