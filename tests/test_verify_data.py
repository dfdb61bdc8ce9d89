"""verify's data and dtype: its batches hold every token id of the vocabulary, the layout's fresh memory is NaN
(an uninitialised read fails loudly), and without --dtype it runs float64 as well where that is cheap."""

import json

import torch

from parallelisms.cli import main
from parallelisms.data import BatchLoader, load_corpus
from parallelisms.training import _poisoned

SMALL = ["--steps", "1", "--global-batch", "4", "--seq-len", "32", "--json"]


def _ids(loader: BatchLoader, step: int) -> set[int]:
    inputs, targets = loader.batch(step)
    return set(inputs.flatten().tolist()) | set(targets.flatten().tolist())


def test_every_token_id_is_in_every_batch_where_it_fits():
    corpus = load_corpus()
    assert max(_ids(BatchLoader(corpus, 16, 64, seed=0), 0)) < 128  # the corpus alone: bytes 10-122
    swept = BatchLoader(corpus, 16, 64, seed=0, vocab_sweep=256)
    for step in range(3):
        assert _ids(swept, step) == set(range(256))
        assert torch.equal(swept.batch(step)[0], swept.batch(step)[0])  # deterministic: layout and reference agree
    small = BatchLoader(corpus, 2, 8, seed=0, vocab_sweep=1000)  # 18 tokens a step: the vocabulary over 56 steps
    assert set().union(*(_ids(small, s) for s in range(56))) >= set(range(1000))


def test_fresh_memory_is_nan_while_poisoned_and_settings_return():
    before = torch.are_deterministic_algorithms_enabled()
    with _poisoned(True):
        assert torch.empty(8).isnan().all() and torch.empty(4, dtype=torch.float64).isnan().all()
    assert torch.are_deterministic_algorithms_enabled() == before
    with _poisoned(False):
        assert torch.are_deterministic_algorithms_enabled() == before


def _verify(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(["verify", "--dp", "1", *SMALL, *argv]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def test_float64_runs_as_well_by_default_and_float32_alone_on_request(capsys):
    both = _verify(capsys)
    assert both["dtype"] == "float32" and both["float64"]["ok"] and both["float64"]["tolerance"] == 1e-10
    assert "float64" not in _verify(capsys, "--dtype", "float32")
    assert _verify(capsys, "--dtype", "float64")["dtype"] == "float64"
