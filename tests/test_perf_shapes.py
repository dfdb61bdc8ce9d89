"""Model shapes on the command line: shape flags over a preset, GPT's GELU MLP, the published presets'
parameter counts, ``hidden_act`` in a Hugging Face config, and bad shapes as one line."""

import json

import pytest

from parallelisms.cli import build_configs, build_parser
from parallelisms.config import PRESETS, ConfigError, load_hf_config

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)


def _model(*argv):
    return build_configs(build_parser().parse_args(["estimate", *argv]))[0]


def test_shape_flags_override_the_preset():
    m = _model("--preset", "tiny", "--layers", "3", "--hidden", "96", "--heads", "6", "--mlp", "gelu", "--seq-len", "256")
    assert (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.mlp) == (3, 96, 6, 6, 384, "gelu")
    assert m.max_seq_len == 256 and m.vocab_size == PRESETS["tiny"].vocab_size
    assert m.num_params() == 2 * 256 * 96 + 3 * (4 * 96 * 96 + 2 * 96 * 384 + 2 * 96) + 96


@pytest.mark.parametrize("name, billions", [("gpt3-175b", 175.2), ("megatron-22b", 22.4), ("megatron-530b", 530.6),
                                            ("megatron-1t", 1009.3), ("llama3-405b", 405.9), ("mixtral-8x7b", 46.7)])
def test_presets_have_their_published_sizes(name, billions):
    assert PRESETS[name].num_params() / 1e9 == pytest.approx(billions, abs=0.05)


def test_hidden_act_selects_the_mlp(tmp_path):
    raw = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 256, "hidden_act": "gelu_new"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert load_hf_config(path).mlp == "gelu"
    path.write_text(json.dumps({**raw, "hidden_act": "relu"}))
    with pytest.raises(ConfigError, match="hidden_act 'relu'"):
        load_hf_config(path)


@pytest.mark.parametrize("argv, match", [(["--heads", "5"], "divisible by --heads"),
                                         (["--experts", "4", "--mlp", "gelu"], "--mlp gelu with experts"),
                                         (["--hidden", "0"], "--hidden")])
def test_bad_shapes_are_one_line(argv, match):
    with pytest.raises(ConfigError, match=match) as err:
        _model(*argv)
    assert "\n" not in str(err.value)
