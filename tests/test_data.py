"""One's own data: text files, directories, memory-mapped .bin tokens and Hugging Face tokenizers; the loader's
exact, layout-independent position; a held-out split whose validation loss a two-rank run reports as
single-process evaluation computes it; and bad data refused in one line before launch."""

from pathlib import Path

import numpy as np
import pytest
import torch

import parallelisms.data
from parallelisms.cli import main
from parallelisms.config import DataConfig, ParallelConfig, TrainConfig, preset
from parallelisms.data.loader import BatchLoader
from parallelisms.data.sources import check_data, load_tokens, split_tokens, training_loader
from parallelisms.errors import ConfigError
from parallelisms.mesh import ParallelDims
from parallelisms.model import build_model
from parallelisms.training import RunSpec

from _launching import assert_reproduces, launch_reports, one_thread

TINY = preset("tiny")
TEXT = "Ring attention passes keys and values around a ring of ranks. " * 400


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "one.txt").write_text(TEXT)
    (root / "dir").mkdir()
    (root / "dir" / "b.txt").write_text(TEXT[len(TEXT) // 2:])
    (root / "dir" / "a.txt").write_text(TEXT[:len(TEXT) // 2])
    ids = np.frombuffer(TEXT.encode(), dtype=np.uint8)
    ids.astype(np.uint16).tofile(root / "tokens16.bin")
    ids.astype(np.uint32).tofile(root / "tokens32.bin")
    (root / "empty.txt").write_text("")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "odd.bin").write_bytes(b"\x01\x02\x03")
    np.full(1000, 300, dtype=np.uint32).tofile(root / "big.bin")
    (root / "nothing").mkdir()
    return root


def test_text_files_directories_and_bins_give_the_same_tokens(data):
    one = load_tokens(DataConfig(path=str(data / "one.txt")))
    assert one.dtype == torch.long and len(one) == len(TEXT.encode())
    parts = load_tokens(DataConfig(path=str(data / "dir")))  # sorted: a.txt, then b.txt, a blank line between
    assert torch.equal(parts[:len(TEXT) // 2], one[:len(TEXT) // 2]) and len(parts) == len(one) + 2
    for name, dtype in (("tokens16.bin", "uint16"), ("tokens32.bin", "uint32")):
        mapped = load_tokens(DataConfig(path=str(data / name), bin_dtype=dtype))
        assert isinstance(mapped, np.memmap) and np.array_equal(np.asarray(mapped), one.numpy())
        # windows read from the map are the windows of the same tokens in memory
        assert torch.equal(BatchLoader(mapped, 4, 16, 7).batch(3)[0], BatchLoader(one, 4, 16, 7).batch(3)[0])


def test_a_hugging_face_tokenizer(data, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    def trained(vocab: int) -> str:
        tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        corpus = (Path(parallelisms.data.__file__).parent / "corpus.txt").read_text()
        tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]"]))
        path = tmp_path / f"tokenizer{vocab}.json"
        tok.save(str(path))
        return str(path)
    small = trained(100)
    cfg = DataConfig(path=str(data / "one.txt"), tokenizer=small)
    ids = load_tokens(cfg)
    assert ids.tolist() == tokenizers.Tokenizer.from_file(small).encode(TEXT).ids
    assert 0 < len(ids) < len(TEXT) and int(ids.max()) < 100  # merges: fewer tokens than bytes
    assert check_data(cfg, TINY, 16) == len(ids)
    with pytest.raises(ConfigError, match=r"has token ids up to 299 but the model.s vocabulary is 256"):
        check_data(DataConfig(path=str(data / "one.txt"), tokenizer=trained(300)), TINY, 16)


def test_the_loader_position_is_exact_and_refuses_other_data():
    tokens = torch.arange(5000) % 256
    loader = BatchLoader(tokens, 8, 16, seed=2)
    for _ in range(3):
        loader.next_shard(0, 2)
    state = loader.state_dict()
    assert state == {"step": 3, "seed": 2, "num_tokens": 5000}
    continued = [loader.next_shard(1, 2), loader.next_shard(0, 2)]  # steps 3 and 4
    resumed = BatchLoader(tokens, 8, 16, seed=2)
    resumed.load_state_dict(state)
    # the position is the step: resumed at another data-parallel degree, the same global batches follow
    assert torch.equal(resumed.next_shard(0, 1)[0][4:], continued[0][0])
    assert torch.equal(resumed.next_shard(0, 4)[0], continued[1][0][:2])
    with pytest.raises(ConfigError, match="--seed 2"):
        BatchLoader(tokens, 8, 16, seed=3).load_state_dict(state)
    with pytest.raises(ConfigError, match="5,000 training tokens"):
        BatchLoader(tokens[:4000], 8, 16, seed=2).load_state_dict(state)


def test_the_held_out_split_is_the_tail():
    tokens = torch.arange(1000)
    train, held = split_tokens(tokens, 0.1)
    assert torch.equal(train, tokens[:900]) and torch.equal(held, tokens[900:])
    assert split_tokens(tokens, 0.0)[1] is None


LAYOUTS = {"dp2": (ParallelConfig(dims=ParallelDims(dp_replicate=2)), 2),
           "pp2": (ParallelConfig(dims=ParallelDims(pp=2), microbatches=2), 2)}


def _specs(data_dir) -> dict:
    data = DataConfig(path=str(data_dir / "tokens16.bin"), eval_split=0.2, eval_every=2, eval_batches=2)
    train = TrainConfig(steps=3, global_batch=4, seq_len=16, data=data)
    return {name: RunSpec(TINY, train, parallel, collect_state=True) for name, (parallel, _) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def reports(data):
    return launch_reports(_specs(data))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_train_on_a_bin_and_report_the_validation_loss(data, reports, layout):
    """Data parallel, and a pipeline (its validation passes hidden states stage to stage, forward only)."""
    spec, report = _specs(data)[layout], reports(layout)
    with one_thread():
        assert_reproduces(report, TINY, spec.train, splits=LAYOUTS[layout][1])  # the reference reads the same .bin
        model = build_model(TINY, 0)
        model.load_state_dict(report["state"])
        _, held = split_tokens(load_tokens(spec.train.data), 0.2)
        loader = BatchLoader(held, 4, 16, spec.train.seed)
        with torch.no_grad():
            expected = sum(model(*loader.batch(b)).item() for b in range(2)) / 2
    assert [step for step, _ in report["eval_losses"]] == [2, 3]
    assert abs(report["eval_losses"][-1][1] - expected) / expected < 1e-5
    assert training_loader(spec.train).tokens.shape[0] == len(TEXT.encode()) - int(len(TEXT.encode()) * 0.2)


@pytest.mark.parametrize("args, message", [
    (["--data", "{d}/empty.txt"], "is empty"),
    (["--data", "{d}/missing.txt"], "does not exist"),
    (["--data", "{d}/latin1.txt"], "is not UTF-8 text"),
    (["--data", "{d}/nothing"], "no .txt files"),
    (["--data", "{d}/odd.bin"], "not a whole number of uint16 tokens"),
    (["--data", "{d}/big.bin", "--data-dtype", "uint32"], "holds token id 300 but the model's vocabulary is 256"),
    (["--data", "{d}/one.txt", "--eval-split", "0.001"], "holds out"),
    (["--data", "{d}/one.txt", "--tokenizer", "{d}/one.txt"], "is not a tokenizer.json"),
    (["--eval-every", "5"], "needs held-out data"),
    (["--pp", "2", "--dp", "2", "--fsdp", "full_shard", "--fsdp-style", "per_param", "--eval-split", "0.1",
      "--eval-every", "2"], "--eval-every 2 with --pp 2 and --fsdp-style per_param"),
    (["--data-dtype", "uint32"], "applies only to a pre-tokenized .bin"),
])
def test_bad_data_is_one_line_before_launch(data, capsys, monkeypatch, args, message):
    import parallelisms.cli_results
    monkeypatch.setattr(parallelisms.cli_results, "run_layout", lambda *a, **k: pytest.fail("launched"))
    argv = ["train", "--steps", "1", "--seq-len", "32"] + [a.format(d=data) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
