"""The plain model, the presets and config.json loading, and the data every layout sees."""

import json

import pytest
import torch

from parallelisms.config import PRESETS, ConfigError, ModelConfig, load_hf_config, preset
from parallelisms.data import BatchLoader, ByteTokenizer, load_corpus
from parallelisms.data.loader import microbatches
from parallelisms.model import build_model

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)


def test_tiny_forward_backward_and_determinism():
    cfg = preset("tiny")
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(build_model(cfg, seed=4).output.weight, a.output.weight)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = a(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    loss = a(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in a.parameters())
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1  # near-uniform at init
    assert sum(p.numel() for p in a.parameters()) == cfg.num_params()


def test_causal_attention_ignores_the_future():
    model = build_model(preset("tiny"))
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    assert torch.allclose(model(tokens)[0, :8], model(changed)[0, :8], atol=1e-6)


def test_positions_argument_matches_default():
    model = build_model(preset("tiny"))
    tokens = torch.randint(0, 256, (2, 10))
    assert torch.equal(model(tokens), model(tokens, positions=torch.arange(10)))


def test_grouped_kv_heads_equal_repeated_full_heads():
    """GQA with n_kv_heads=2 equals MHA whose K/V projections repeat each KV head's rows."""
    gqa_cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)
    mha_cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=64)
    gqa, mha = build_model(gqa_cfg, 0), build_model(mha_cfg, 0)
    state = gqa.state_dict()
    hd = gqa_cfg.head_dim
    for key in ("layers.0.attention.wk.weight", "layers.0.attention.wv.weight"):
        state[key] = state[key].view(2, hd, 32).repeat_interleave(2, dim=0).reshape(4 * hd, 32)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 9))
    assert torch.allclose(gqa(tokens), mha(tokens), atol=1e-5)


def test_meta_build_allocates_nothing():
    model = build_model(preset("llama3-8b"), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == preset("llama3-8b").num_params() == 8_030_261_248


def test_hf_config_loading(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8,
                                "num_key_value_heads": 2, "intermediate_size": 344, "vocab_size": 1000,
                                "max_position_embeddings": 256, "rope_theta": 500000.0, "rms_norm_eps": 1e-6,
                                "model_type": "llama"}))
    cfg = load_hf_config(path)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size) == (128, 3, 8, 2, 344, 1000)
    assert cfg.rope_theta == 500000.0 and cfg.norm_eps == 1e-6
    path.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                                "intermediate_size": 128, "vocab_size": 50}))
    assert load_hf_config(path).n_kv_heads == 4  # absent: multi-head attention


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"hidden_size": 64}), "lacks"),
    (json.dumps({"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 5, "intermediate_size": 8,
                 "vocab_size": 10}), "divisible by n_heads"),
    (json.dumps({"hidden_size": "wide", "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 8,
                 "vocab_size": 10}), "hidden_size must be an integer"),
])
def test_malformed_hf_config(tmp_path, content, fragment):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=fragment):
        load_hf_config(path)


def test_every_preset_is_valid():
    for name in PRESETS:
        preset(name).validate()
    with pytest.raises(ConfigError, match="unknown --preset"):
        preset("huge")


def test_corpus_tokenizer_and_loader():
    tokens = load_corpus()
    assert tokens.numel() > 100_000 and tokens.max() < 256
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("ring attention")) == "ring attention"
    loader = BatchLoader(tokens, global_batch=8, seq_len=32, seed=1)
    inputs, targets = loader.batch(5)
    again, _ = BatchLoader(tokens, 8, 32, seed=1).batch(5)
    assert torch.equal(inputs, again) and not torch.equal(inputs, loader.batch(6)[0])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    shards = [loader.shard(5, rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat([s[0] for s in shards]), inputs)
    assert torch.equal(torch.cat([s[1] for s in shards]), targets)
    micro = microbatches(inputs, targets, 4)
    assert len(micro) == 4 and torch.equal(torch.cat([m[0] for m in micro]), inputs)
