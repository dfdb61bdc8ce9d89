"""The benches' measurements: what a call holds at once (and nothing allocated before it), the
least peak a ZeRO stage can have, built from it (``bench zero*``'s ``peak_floor_ratio``), and the rounds of
``alternate`` behind each bench's ``ratio_rounds``."""

import torch

from parallelisms.bench import transient_peak
from parallelisms.benches.zero import peak_floor
from parallelisms.config import TrainConfig, preset
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.model import build_model
from parallelisms.parallel.wrap import module_units


def test_transient_peak_counts_what_a_call_holds_at_once():
    before = torch.ones(1_000_000)  # allocated before the call: not counted
    peak = transient_peak(lambda: [torch.ones(250_000), torch.ones(250_000)])
    assert 2_000_000 <= peak < 2_100_000
    assert 4_000_000 <= transient_peak(lambda: [torch.ones(250_000) for _ in range(4)][-1]) < 4_100_000
    del before


def test_peak_floor_holds_the_stage_s_parameters_and_a_share_of_adam():
    model_cfg, train_cfg = preset("tiny"), TrainConfig(global_batch=4, seq_len=32, grad_clip=0.0)
    batch = BatchLoader(load_corpus(), 4, 32).shard(0, 0, 2)
    model = build_model(model_cfg)
    params = sum(p.numel() * 4 for p in model.parameters())
    unit = max(sum(p.numel() * 4 for m in modules for p in m.parameters()) for _, modules in module_units(model))
    floors = {stage: peak_floor(stage, 2, model_cfg, train_cfg, batch) for stage in (1, 2, 3)}
    assert floors[1] == floors[2] > floors[3]
    # stages 1-2 hold every parameter, stage 3 a half and one unit; the transient bytes are measured, so the
    # difference is within a small allocation of the formula's
    assert abs((floors[1] - floors[3]) - (params - params // 2 - unit)) < 0.05 * params
    assert floors[3] > params // 2 + unit + params  # plus Adam's two moments over half the parameters, plus activations


def test_alternate_keeps_every_step_for_per_round_ratios():
    from parallelisms.bench import alternate, round_ratios

    times = alternate({"ours": lambda: None, "peer": lambda: None}, steps=3, rounds=4)
    assert len(times.samples["ours"]) == 12 and len(times.per_round("ours", 4)) == 4
    times.samples.update(ours=[1.0] * 6 + [3.0] * 6, peer=[2.0] * 12)  # two rounds of six steps
    assert round_ratios(times, "ours", "peer", 2) == [0.5, 1.5]
