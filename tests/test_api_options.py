"""The Python API's keywords (parallelisms.api_options) give each verb the settings and configs its command line
gives, with no flags written or parsed; a bad keyword or value is one line."""

import pytest

import parallelisms
from parallelisms.api_options import settings
from parallelisms.cli import build_parser
from parallelisms.cli_configs import build_configs
from parallelisms.errors import ConfigError

pytestmark = pytest.mark.fast  # no process starts (tests/conftest.py)

LAYOUTS = [
    dict(dp=2),
    dict(dp=1, tp=2, sp=True, tp_overlap=True, global_batch=8),
    dict(dp_shard=2, fsdp="full_shard", fsdp_style="per_param", mixed_precision="bf16"),
    dict(dp_replicate=2, dp_shard=2, fsdp="hybrid_shard", fsdp_prefetch=2),
    dict(dp=2, zero=1, overlap_param_gather=True, recompute="full"),
    dict(pp=2, schedule="zb-v", microbatches=4, layers=4),
    dict(pp=2, dp=2, schedule="interleaved", chunks=2, layers=4, pp_balance="layers"),
    dict(cp=2, cp_attention="ulysses", dtype="float64"),
    dict(cp=4, cp_attention="hierarchical", cp_ulysses_size=2, seq_len=64),
    dict(ep=2, dp=2, experts=4, topk=2, ep_balance="measured", ep_redundant=1),
    dict(dp=2, betas=(0.9, 0.99), lr=1e-3, weight_decay=0.1, grad_clip=0.5, seed=3, warmup=2, lr_schedule="cosine"),
    dict(preset="small", hidden=128, heads=4, mlp="gelu", tie_embeddings=True, dp=1),
]


def _flags(options: dict) -> list[str]:
    """The command line a user would type for ``options``."""
    argv = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return argv


def _cli(verb: str, options: dict):
    return build_parser().parse_args([verb, *_flags(options)])


@pytest.mark.parametrize("options", LAYOUTS, ids=lambda o: ",".join(o))
def test_configure_equals_the_command_lines_configs(options):
    assert tuple(parallelisms.configure(**options)) == build_configs(_cli("train", options))


@pytest.mark.parametrize("verb, options", [
    ("verify", dict(dp=2, steps=2, zero=3, tolerance=1e-6)),
    ("train", dict(dp=1, predict=True, trace="t.json", metrics="m.jsonl", save="ckpt", save_every=2)),
    ("estimate", dict(preset="llama3-8b", dp=8, tp=2, sp=True, fp8=True, hardware="a100")),
    ("plan", dict(gpus=8, preset="small", top=3, tp=2)),
    ("simulate", dict(schedule="zb-v", pp=4, microbatches=8)),
])
def test_each_verbs_settings_equal_its_command_lines(verb, options):
    ours, theirs = settings(verb, options), vars(_cli(verb, options))
    ours.pop("func"), theirs.pop("func")  # plan's is a closure of its own parser
    assert ours == theirs
    assert {k: type(v) for k, v in ours.items()} == {k: type(v) for k, v in theirs.items()}


def test_each_verbs_typed_configuration_equals_its_command_lines(tmp_path):
    from parallelisms.cli_results import estimate_run, train_run, verify_run

    options = dict(preset="llama3-8b", dp=8, tp=2, sp=True, fp8=True, hardware="a100", kernels="fused")
    assert estimate_run(settings("estimate", options)) == estimate_run(_cli("estimate", options))
    options = dict(dp=1, no_precheck=True, device="cpu", trace=str(tmp_path / "t.json"), predict=True,
                   save=str(tmp_path / "ckpt"), save_every=2, skip_nonfinite=True, metrics=str(tmp_path / "m.jsonl"),
                   warmup=2, lr_schedule="cosine")
    run = train_run(settings("train", options))
    assert run == train_run(_cli("train", options))
    assert (run.predict, run.train.nonfinite, run.checkpoint.save_every, run.files.metrics) == (
        "cpu", "skip", 2, options["metrics"])
    options = dict(dp=1, no_precheck=True, device="cpu", tolerance=1e-6)
    assert verify_run(settings("verify", options)) == verify_run(_cli("verify", options))


def test_configure_then_argv_flags_override_the_keywords():
    cfg = parallelisms.configure(["--tp", "2", "--sp"], dp=1, tp=4, seed=5)
    assert cfg.layout.dims.tp == 2 and cfg.layout.sequence_parallel and cfg.train.seed == 5


def test_a_config_file_is_read_under_the_keywords(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text('[layout]\ndp = 2\nzero = 1\n[training]\nsteps = 7\n[optimizer]\nbetas = [0.9, 0.99]\n')
    cfg = parallelisms.configure(config_file=str(run), steps=3)
    assert tuple(cfg) == build_configs(build_parser().parse_args(["train", "--config-file", str(run), "--steps", "3"]))
    assert cfg.train.steps == 3 and cfg.train.betas == (0.9, 0.99) and cfg.layout.zero == 1
    run.write_text("[layout]\ndp = 0\n")
    with pytest.raises(ConfigError, match=r"^--config-file '.*run.toml': argument --dp: must be an integer from 1"):
        parallelisms.configure(config_file=str(run))


NO_FLAG = ("unknown keyword", "argument --sp: a switch")  # a keyword's own mistakes, which no flag can make


@pytest.mark.parametrize("verb, options, line", [
    ("train", dict(tp_overlp=True), r"^unknown keyword 'tp_overlp' for parallelisms.train: did you mean tp_overlap or "
                                    r"tp_overlap_chunks\?"),
    ("verify", dict(frobnicate=1), r"^unknown keyword 'frobnicate' for parallelisms.verify: see parallelisms verify "
                                   r"--help"),
    ("estimate", dict(sequence_parallel=True), r"^unknown keyword 'sequence_parallel' .*"),
    ("train", dict(dp=0), r"^argument --dp: must be an integer from 1 to 65,536, got 0 \(see parallelisms train"),
    ("train", dict(dp=2.5), r"^argument --dp: must be an integer from 1 to 65,536, got '2.5'"),
    ("train", dict(sp=2), r"^argument --sp: a switch; give True or False, got 2"),
    ("train", dict(mlp="relu"), r"^argument --mlp: invalid choice: 'relu'"),
    ("train", dict(betas=(0.9,)), r"^argument --betas: must be two numbers"),
    ("plan", dict(preset="small"), r"^the following arguments are required: --gpus"),
    ("train", dict(tp=2, recompute="some"), r"^unknown --recompute 'some'; choose one of none, selective, full$"),
    ("train", dict(dp=1, cp_attention="ulysses"), r"^--cp-attention ulysses applies only with --cp 2 or more"),
])
def test_bad_keywords_raise_one_line(verb, options, line):
    with pytest.raises(ConfigError, match=line) as caught:
        if verb == "train":
            parallelisms.configure(**options)
        else:
            build_configs(settings(verb, options), runtime=False)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError) as cli:  # the command line says the same where a flag can say it
        build_configs(_cli(verb, options), runtime=False)
    if not str(caught.value).startswith(NO_FLAG):
        assert str(cli.value) == str(caught.value)
