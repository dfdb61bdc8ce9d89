"""The closed forms of perf/model.py against published figures (ZeRO, Korthikanti, Narayanan)
and against what the runtime measures (the ledger of a real run)."""

import pytest

from parallelisms.config import ParallelConfig, TrainConfig, preset
from parallelisms.mesh import ParallelDims
from parallelisms.perf.model import (activation_bytes_per_layer, comm_per_step, gpt_flops_per_iteration, gpt_params,
                                     model_flops_per_token, model_state_bytes, pipeline_activation_factor)

MIB = 2**20


@pytest.mark.parametrize("kwargs, mib", [
    ({}, 2736), ({"tp": 8}, 552), ({"tp": 8, "sequence_parallel": True}, 342),
    ({"tp": 8, "recompute": "selective"}, 312), ({"tp": 8, "sequence_parallel": True, "recompute": "selective"}, 102),
    ({"tp": 8, "recompute": "full"}, 48),
])
@pytest.mark.fast
def test_korthikanti_table2_worked_values(kwargs, mib):
    """GPT-3 175B: a=96, h=12288, s=2048, b=1, t=8 (MiB per layer)."""
    got = activation_bytes_per_layer(seq=2048, batch=1, hidden=12288, heads=96, **kwargs) / MIB
    assert got == pytest.approx(mib, abs=0.5)


@pytest.mark.fast
def test_interleaving_multiplies_first_stage_activations():
    assert pipeline_activation_factor(pp=4) == 1.0
    assert pipeline_activation_factor(pp=4, chunks=2) == pytest.approx(1 + 3 / 8)


@pytest.mark.parametrize("n, stage, gb", [(4, 1, 52.5), (4, 2, 41.3), (4, 3, 30), (64, 1, 31.4), (64, 2, 16.6),
                                          (64, 3, 1.88), (1024, 3, 0.12), (16, 2, 21.6)])
@pytest.mark.fast
def test_zero_table1_7_5b(n, stage, gb):
    """ZeRO Table 1, 7.5B parameters, mixed-precision Adam (K = 12): GB per device (the paper truncates)."""
    parallel = ParallelConfig(ParallelDims(dp_shard=n), zero=stage, mixed_precision="bf16")
    got = model_state_bytes(7_500_000_000, parallel)["total"] / 1e9
    assert got == pytest.approx(gb, abs=0.06)


@pytest.mark.parametrize("layers, hidden, billions", [(24, 2304, 1.7), (30, 3072, 3.6), (36, 4096, 7.5)])
@pytest.mark.fast
def test_narayanan_parameter_counts(layers, hidden, billions):
    assert gpt_params(layers, hidden, vocab=51200, seq=2048) / 1e9 == pytest.approx(billions, abs=0.06)


@pytest.mark.fast
def test_flops_formulas():
    # recompute adds one forward: 96 vs 72 on the layer term
    full = gpt_flops_per_iteration(512, 2048, 24, 2304, 51200, full_recompute=True)
    model = gpt_flops_per_iteration(512, 2048, 24, 2304, 51200, full_recompute=False)
    assert 1.25 < full / model < 1.34
    # ours: 6 x matmul params per token plus attention, about 6 N for a short sequence
    cfg = preset("llama3-8b")
    per_token = model_flops_per_token(cfg, seq=1)
    matmul = cfg.num_params() - cfg.vocab_size * cfg.dim - cfg.dim * (2 * cfg.n_layers + 1)
    assert per_token == pytest.approx(6 * matmul + 12 * cfg.n_layers * cfg.dim)


@pytest.mark.fast
def test_comm_volumes_follow_the_spec():
    cfg, train = preset("tiny"), TrainConfig(global_batch=16, seq_len=32)
    g = cfg.num_params() * 4
    dp = comm_per_step(cfg, ParallelConfig(ParallelDims(dp_replicate=4)), train)
    assert [(c.kind, c.bytes_per_rank) for c in dp] == [("all_reduce", 1.5 * g)]
    norm_over_4 = 2 * (3 / 4) * 4  # the gradient norm: one fp32 squared norm all-reduced over the 4 shards
    zero3 = comm_per_step(cfg, ParallelConfig(ParallelDims(dp_shard=4), zero=3), train)
    assert sum(c.bytes_per_rank for c in zero3) == pytest.approx(1.5 * 1.5 * g + norm_over_4)
    zero2 = comm_per_step(cfg, ParallelConfig(ParallelDims(dp_shard=4), zero=2), train)
    assert sum(c.bytes_per_rank for c in zero2) == pytest.approx(1.5 * g + norm_over_4)
    tp = comm_per_step(cfg, ParallelConfig(ParallelDims(tp=2)), train)
    tokens = 16 * 32
    a = tokens * cfg.dim * 4
    # all-reduces of A: two per block each way, the embedding's output, the head input's gradient; the
    # cross-entropy's (one fp32 per token, then two); then the norm of the tensor-parallel shards summed over tp
    assert [(c.kind, c.bytes_per_rank) for c in tp] == [
        ("all_reduce", 2 * (1 / 2) * ((4 * cfg.n_layers + 2) * a + 3 * 4 * tokens)), ("all_reduce", 2 * (1 / 2) * 4)]
    sp = comm_per_step(cfg, ParallelConfig(ParallelDims(tp=2), sequence_parallel=True), train)
    # per block all-gathers 2 forward, 4 backward (2 re-gathers), reduce-scatters 2 and 2; the embedding's
    # reduce-scatter and gradient all-gather; the head's gather, re-gather and gradient reduce-scatter; the
    # norm weights' gradients (two per block and the final one) all-reduced
    assert [(c.kind, c.bytes_per_rank) for c in sp[:3]] == [
        ("all_gather", (6 * cfg.n_layers + 3) * a / 2), ("reduce_scatter", (4 * cfg.n_layers + 2) * a / 2),
        ("all_reduce", 3 * 4 * tokens + (2 * cfg.n_layers + 1) * cfg.dim * 4)]


LEDGER_RUNS = [["--dp", "2", "--cp", "2"], ["--dp", "1", "--cp", "2", "--cp-attention", "ulysses"],
               ["--dp", "1", "--cp", "2", "--cp-attention", "allgather"],
               ["--dp", "1", "--cp", "4", "--cp-attention", "hierarchical", "--cp-ulysses-size", "2"],
               ["--dp", "2", "--zero", "3", "--mixed-precision", "bf16", "--grad-clip", "0"],
               ["--dp", "2", "--zero", "3", "--grad-accum", "2"],  # every microbatch: gathers,
               ["--dp", "2", "--fsdp", "shard_grad_op", "--grad-accum", "2"],  # reductions
               ["--dp", "1", "--pp", "2", "--schedule", "interleaved", "--chunks", "2", "--layers",
                "4", "--grad-clip", "0"],
               ["--dp", "1", "--tp", "2", "--grad-accum", "2"],
               ["--dp", "1", "--tp", "2", "--sp", "--recompute", "full"],
               ["--dp", "1", "--pp", "2", "--tp", "2", "--sp", "--microbatches", "4"],
               ["--dp", "1", "--pp", "2", "--tp", "2", "--schedule", "zb-v", "--layers", "4"],
               ["--dp", "2", "--tp", "2", "--sp"],
               ["--dp", "2", "--pp", "2", "--schedule", "zb-v", "--layers", "4"]]


def _configs(argv):
    """The model, train and parallel configs of ``train ARGV --steps 2 --global-batch 8``, built as the CLI builds them."""
    from parallelisms.cli import build_parser
    from parallelisms.cli_configs import build_configs

    return build_configs(build_parser().parse_args(["train", *argv, "--steps", "2", "--global-batch", "8"]))


@pytest.fixture(scope="module")
def ledger_runs():
    """argv joined -> rank 0's report of its run (one launch per world size)."""
    from _launching import launch_reports
    from parallelisms.training import RunSpec

    return launch_reports({" ".join(argv): RunSpec(*_configs(argv)) for argv in LEDGER_RUNS})


@pytest.mark.parametrize("argv", LEDGER_RUNS, ids=" ".join)
def test_prediction_matches_the_ledger_of_a_real_run(ledger_runs, argv):
    """The bytes per rank of each collective kind in a real run's ledger equal ``predicted_comm_by_kind`` (which
    ``train --json`` reports as ``predicted_comm``, checked through the CLI below)."""
    from parallelisms.perf.model import predicted_comm_by_kind

    model, train, parallel = _configs(argv)
    report = ledger_runs(" ".join(argv))
    predicted = predicted_comm_by_kind(model, parallel, train, dtype_bytes=2 if parallel.mixed_precision == "bf16" else 4)
    measured = {k: v["bytes_per_rank"] for k, v in report["comm"].items() if v["bytes_per_rank"] > 0}
    assert measured.keys() == predicted.keys()
    for kind, value in predicted.items():
        assert measured[kind] == pytest.approx(value, rel=1e-12), kind


@pytest.mark.fast
def test_estimate_command(capsys):
    import json

    from parallelisms.cli import main

    argv = ["estimate", "--preset", "llama3-8b", "--dp", "64", "--fsdp", "full_shard", "--global-batch", "512",
            "--seq-len", "8192", "--mixed-precision", "bf16", "--recompute", "full", "--grad-accum", "8", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    mem = result["memory_per_rank"]
    # ZeRO-3: K Psi / N, the fp32 master weights (4 Psi / N) counted as params, Adam's moments as optimizer
    assert mem["params"] + mem["optimizer"] == pytest.approx(12 * 8_030_261_248 / 64, rel=1e-6)
    # full recompute: 2sbh x L kept, b = 512 / 64 / 8, and the loss's peak on the fp32 logits (log-probabilities, their
    # gradient and the log-softmax's: 12 bytes a logit) with the final norm's kept tensors (fp32 input, two bf16)
    assert mem["activations"] == pytest.approx(2 * 8192 * 1 * 4096 * 32 + 8192 * (12 * 128256 + 8 * 4096))
    assert result["fits"] is True
    # gathered for forward and backward of each of the 8 microbatches (as the flat engine's ledger counts)
    assert result["comm_bytes_per_rank"]["all_gather/dp"] == pytest.approx(8 * 2 * 63 / 64 * 2 * 8_030_261_248)
    assert main(["estimate", "--hardware", "tpu"]) == 2
    assert "unknown --hardware 'tpu'" in capsys.readouterr().err
    assert main(["estimate", "--attention", "naive"]) == 2


@pytest.mark.fast
def test_redundant_experts_sum_their_gradients_over_ep():
    """EPLB's copies (``--ep-balance measured --ep-redundant R``): each rank holds n/ep + R experts per layer, which
    its expert-replica all-reduce carries, and the min(n, ep x R) replicated experts' gradients are all-reduced
    over ep once a step (ring: 2 (ep - 1) / ep of their fp32 bytes)."""
    cfg, train = preset("tiny-moe"), TrainConfig(global_batch=16, seq_len=32)
    expert = cfg.mlp_matrices * cfg.dim * cfg.ffn_dim
    for dp, ep, redundant in ((2, 2, 1), (4, 2, 3), (4, 4, 2), (8, 4, 1)):
        even = ParallelConfig(ParallelDims(dp_replicate=dp, ep=ep))
        placed = even.replace(ep_balance="measured", ep_redundant=redundant)
        plain, ours = comm_per_step(cfg, even, train), comm_per_step(cfg, placed, train)
        copies = cfg.n_layers * min(cfg.n_experts, ep * redundant) * expert * 4
        assert [c.bytes_per_rank for c in ours
                if c.dim == "ep" and c.kind == "all_reduce" and c.bytes_per_rank > 64] == pytest.approx(
            [2 * (ep - 1) / ep * copies])
        replicas = dp // ep
        slots = (cfg.n_experts // ep + redundant, cfg.n_experts // ep)
        assert [(ours[i].bytes_per_rank, plain[i].bytes_per_rank) for i, c in enumerate(plain)
                if c.dim == "ep_replicate" and c.bytes_per_rank > 64] == pytest.approx(
            [tuple(2 * (replicas - 1) / replicas * cfg.n_layers * n * expert * 4 for n in slots)] if replicas > 1 else [])
        rest = [c for c in ours if c.dim not in ("ep", "ep_replicate")]
        assert rest == [c for c in plain if c.dim not in ("ep", "ep_replicate")]
        a2a = [sum(c.bytes_per_rank for c in volumes if c.kind == "all_to_all") for volumes in (plain, ours)]
        assert a2a[1] - a2a[0] == pytest.approx(cfg.n_layers * (ep - 1) / ep * ep * redundant * 8)  # a count per slot
    sharded = ParallelConfig(ParallelDims(dp_shard=4, ep=2), zero=2, ep_balance="measured", ep_redundant=1)
    copies = cfg.n_layers * 2 * expert * 4  # ZeRO shards the slots over the 2 replicas: their ranges summed over them
    assert [c.bytes_per_rank for c in comm_per_step(cfg, sharded, train) if c.kind == "all_reduce" and
            c.bytes_per_rank > 64][-2:] == pytest.approx([2 * (1 / 2) * copies, 2 * (1 / 2) * copies])
    no_copies = ParallelConfig(ParallelDims(dp_replicate=2, ep=2), ep_balance="measured")
    assert [c for c in comm_per_step(cfg, no_copies, train) if c.kind == "all_reduce" and c.dim == "ep"
            and c.bytes_per_rank > 64] == []  # the norm's scalar only


def test_redundant_experts_all_reduce_matches_the_ledger_of_a_real_run(capsys):
    """The collectives of a real ZeRO-2 ``--ep-balance measured --ep-redundant 1`` run equal the prediction to the
    byte: the all-reduces (the copies' gradients over ep and over the expert replicas, the norm), the dense and
    expert gradients' reduce-scatters and the parameters' all-gathers (over dp and over the expert replicas); the
    all-to-alls follow the router, which the prediction takes as uniform, so they are left out."""
    import json

    from parallelisms.cli import main

    argv = ["train", "--preset", "tiny-moe", "--dp", "4", "--ep", "2", "--zero", "2", "--ep-balance", "measured",
            "--ep-redundant", "1", "--steps", "2", "--global-batch", "8", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        assert report["comm"][kind]["bytes_per_rank"] == pytest.approx(report["predicted_comm"][kind], rel=1e-12)
