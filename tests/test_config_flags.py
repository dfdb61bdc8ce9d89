"""The training and model-shape flags are generated from TrainConfig's and ModelConfig's tables
(parallelisms.config.TRAIN_FLAGS, MODEL_FLAGS): every field meant to be a flag has one, every generated flag
sets its field, and build_configs builds the configs from the parsed values by field name."""

import dataclasses

import pytest

from parallelisms.cli import build_parser
from parallelisms.cli_configs import build_configs
from parallelisms.config import MODEL_FLAGS, TRAIN_FLAGS, ModelConfig, TrainConfig
from parallelisms.data.options import data_settings

pytestmark = pytest.mark.fast  # parsing only: no process starts (tests/conftest.py)

# TrainConfig's fields that other flags set: the data and schedule flags (data_settings), --skip-nonfinite
NOT_TRAIN_FLAGS = {"data", "warmup", "lr_schedule", "min_lr", "nonfinite"}
# ModelConfig's fields a preset or a config.json sets, with no flag of their own
NOT_MODEL_FLAGS = {"max_seq_len", "rope_theta", "norm_eps", "capacity_factor", "aux_loss_coef", "router_skew",
                   "qkv_bias", "out_bias", "qk_norm", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                   "rope_high_freq_factor", "rope_original_max_len", "sliding_window", "hf_model_type"}
# a value other than the default for each training flag, and the field value it gives
GIVEN = {"steps": ("7", 7), "global_batch": ("8", 8), "seq_len": ("32", 32), "grad_accum": ("2", 2),
         "lr": ("0.01", 0.01), "grad_clip": ("0.5", 0.5), "weight_decay": ("0.1", 0.1),
         "betas": ("0.8,0.9", (0.8, 0.9)), "eps": ("1e-6", 1e-6), "decay_all": (None, True), "seed": ("3", 3),
         "bucket_mb": ("4", 4.0), "timeout_s": ("30", 30.0), "dtype": ("float64", "float64"),
         "slow_rank": ("0:2", (0, 2.0))}


def _verb(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def _fields(config) -> set[str]:
    return {f.name for f in dataclasses.fields(config)}


def test_every_training_field_is_one_flag_or_another_flags():
    owned = [f.field for f in TRAIN_FLAGS]
    assert len(owned) == len(set(owned))
    assert set(owned) == _fields(TrainConfig) - NOT_TRAIN_FLAGS
    assert set(data_settings(build_parser().parse_args(["train"]))) | {"nonfinite"} == NOT_TRAIN_FLAGS
    assert set(GIVEN) == set(owned)


def test_every_model_flag_sets_a_field_and_the_rest_come_from_a_file():
    owned = [f.field for f in MODEL_FLAGS]
    assert len(owned) == len(set(owned))
    assert set(owned) == _fields(ModelConfig) - NOT_MODEL_FLAGS


@pytest.mark.parametrize("verb", ["train", "verify", "estimate", "plan", "dryrun"])
def test_each_generated_flag_is_in_every_verbs_parser(verb):
    dests = {a.dest: a for a in _verb(verb)._actions}
    for flag in TRAIN_FLAGS + MODEL_FLAGS:
        assert flag.name in dests[flag.dest].option_strings, (verb, flag.name)


def test_build_configs_sets_each_training_field_from_its_flag():
    by_field = {f.field: f for f in TRAIN_FLAGS}
    argv = ["train", "--dp", "1"]
    for name, (text, _) in GIVEN.items():
        argv += [by_field[name].name] + ([text] if text is not None else [])
    _, train, _ = build_configs(build_parser().parse_args(argv), runtime=False)
    assert {name: getattr(train, name) for name in GIVEN} == {name: value for name, (_, value) in GIVEN.items()}


def test_build_configs_sets_each_model_field_from_its_shape_flag():
    argv = ["train", "--layers", "3", "--hidden", "96", "--heads", "6", "--kv-heads", "3", "--head-dim", "16",
            "--ffn", "200", "--vocab", "300", "--experts", "4", "--topk", "1", "--mlp", "swiglu", "--tie-embeddings"]
    model, _, _ = build_configs(build_parser().parse_args(argv), runtime=False)
    assert {f.field: getattr(model, f.field) for f in MODEL_FLAGS} == dict(
        n_layers=3, dim=96, n_heads=6, n_kv_heads=3, head_dim_override=16, ffn_dim=200, vocab_size=300, n_experts=4,
        top_k=1, mlp="swiglu", tie_embeddings=True)
