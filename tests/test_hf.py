"""Hugging Face Llama weights in and out: a small random ``LlamaForCausalLM`` built by ``transformers`` is read by
``load_hf`` and computes the same logits in our model; training starts from it on two ranks (``--init-from``);
the trained weights exported by ``export_hf`` load in ``transformers`` and give our logits to 1e-5."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from parallelisms.cli import main  # noqa: E402
from parallelisms.config import ParallelConfig, TrainConfig  # noqa: E402
from parallelisms.errors import ConfigError  # noqa: E402
from parallelisms.hf import export_hf, load_hf  # noqa: E402
from parallelisms.launch import launch  # noqa: E402
from parallelisms.mesh import ParallelDims  # noqa: E402
from parallelisms.model import build_model  # noqa: E402
from parallelisms.training import RunSpec, train_rank  # noqa: E402

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def random_llama(path, **changes):
    """A random Llama (2 layers, GQA, rope_theta 5e5; ``changes`` to its config) saved in ``path`` as config.json +
    model.safetensors."""
    cfg = transformers.LlamaConfig(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
                                      **changes})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return random_llama(tmp_path_factory.mktemp("llama"))


def _hf_logits(path) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def _our_logits(cfg, state) -> torch.Tensor:
    model = build_model(cfg, 0)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(TOKENS)


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_a_transformers_llama_computes_the_same_logits_here(hf_dir):
    cfg, state = load_hf(hf_dir)
    assert (cfg.dim, cfg.n_kv_heads, cfg.ffn_dim, cfg.rope_theta) == (64, 2, 96, 500000.0)
    assert _rel(_our_logits(cfg, state), _hf_logits(hf_dir)) < 1e-5


def _train(info, world, spec):
    return train_rank(info, spec)


def test_train_from_it_export_and_load_in_transformers(hf_dir, tmp_path):
    cfg, start = load_hf(hf_dir)
    train = TrainConfig(steps=3, global_batch=4, seq_len=32, lr=1e-2)
    spec = RunSpec(cfg, train, ParallelConfig(dims=ParallelDims(dp_shard=2)).replace(zero=3), collect_state=True,
                   init_from=str(hf_dir))
    report = launch(_train, 2, 2, spec)[0]
    state = report["state"]
    assert any(_rel(state[n], start[n]) > 1e-3 for n in start)  # it trained
    # from the checkpoint's weights, not the seeded ones: the first loss is the checkpoint's
    first = build_model(cfg, 0)
    first.load_state_dict(start)
    from parallelisms.data.sources import training_loader
    with torch.no_grad():
        assert abs(first(*training_loader(train).batch(0)).item() - report["losses"][0]) < 1e-5
    out = export_hf(state, cfg, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert _rel(_hf_logits(out), _our_logits(cfg, state)) < 1e-5
    again_cfg, again = load_hf(out)  # and back: the round trip is exact
    assert again_cfg == cfg and all(torch.equal(again[n], state[n].float()) for n in state)


def test_the_cli_trains_from_and_exports_to_hugging_face(hf_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["train", "--init-from", str(hf_dir), "--dp", "1", "--steps", "2", "--global-batch", "2",
                 "--seq-len", "16", "--export-hf", str(out)]) == 0
    assert "exported to" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file()


def test_bad_hugging_face_directories_are_one_line(tmp_path, hf_dir):
    with pytest.raises(ConfigError, match="has no model.safetensors"):
        load_hf(tmp_path)
    bad = tmp_path / "gelu"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    config = json.loads((hf_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        load_hf(bad)
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(ConfigError, match="has shape"):
        load_hf(bad)
