"""A config dataclass's field with a Flag (parallelisms.flags) is a command-line flag, a Python API keyword and a
``--config-file`` key, with no other edit: checked on a throwaway dataclass through the same machinery the verbs
use, and on every flag table of the real verbs."""

import dataclasses
import re

import pytest

from parallelisms.api_options import settings, verb_parser
from parallelisms.cli_args import Parser
from parallelisms.cli_configs import DP_FLAGS, LAUNCH_FLAGS, MODEL_SOURCE_FLAGS, DataParallelDegrees
from parallelisms.cli_results import (TRAIN_RUN_FLAGS, VERIFY_RUN_FLAGS, estimate_run, plan_run)
from parallelisms.config import MODEL_FLAGS, TRAIN_FLAGS, DataConfig
from parallelisms.config_file import CONFIG_FLAG, sections
from parallelisms.data.options import (DATA_FLAGS, EVAL_FLAGS, RUN_FILE_FLAGS, SCHEDULE_FLAGS, RunFiles, data_settings,
                                       run_files)
from parallelisms.errors import ConfigError
from parallelisms.flags import Flag, add_flags, given_fields, integer
from parallelisms.dryrun.cli import DRYRUN_FLAGS, DryrunOptions
from parallelisms.parallel.pipeline.cli import SIMULATE_FLAGS, SimulateRun, simulate_run
from parallelisms.perf.plan import PLAN_FLAGS, PlanRun
from parallelisms.perf.shapes import PRICING_FLAGS, Pricing
from parallelisms.resume import CHECKPOINT_FLAGS

pytestmark = pytest.mark.fast  # parsing only: no process starts (tests/conftest.py)


@dataclasses.dataclass(frozen=True)
class Knobs:
    """A config that exists only in this test."""

    new_knob: int = 3
    loud: bool = False


KNOB_FLAGS = (Flag("new_knob", "a knob no verb has", parse=integer(1, 10)), Flag("loud", "a switch no verb has"))
BAD = "argument --new-knob: must be an integer from 1 to 10, got 11"


def _parser() -> Parser:
    """A verb with a config file and the throwaway config's flags in its training group, as the verbs build theirs."""
    p = Parser(prog="parallelisms demo")
    p.add_argument(CONFIG_FLAG, metavar="RUN_TOML")
    add_flags(p.add_argument_group("training"), KNOB_FLAGS, Knobs)
    return p


def _knobs(values) -> Knobs:
    return Knobs(**given_fields(KNOB_FLAGS, values))


def test_a_new_field_is_a_flag_a_keyword_and_a_file_key(tmp_path):
    p = _parser()
    assert re.search(r"--new-knob NEW_KNOB +a knob no verb has \(default: 3\)", p.format_help())
    assert _knobs(p.parse_args([])) == _knobs(settings("demo", {}, p)) == Knobs()
    wanted = Knobs(new_knob=5, loud=True)
    assert _knobs(p.parse_args(["--new-knob", "5", "--loud"])) == wanted  # the command line
    assert _knobs(settings("demo", {"new_knob": 5, "loud": True}, p)) == wanted  # the Python API
    run = tmp_path / "run.toml"
    run.write_text("[training]\nnew_knob = 5\nloud = true\n")
    assert sections(p) == {"training": {"new_knob": p._option_string_actions["--new-knob"],
                                        "loud": p._option_string_actions["--loud"]}}
    assert _knobs(p.parse_args([CONFIG_FLAG, str(run)])) == wanted  # the file, on the command line
    assert _knobs(settings("demo", {"config_file": str(run)}, p)) == wanted  # the file, in the API
    assert _knobs(p.parse_args([CONFIG_FLAG, str(run), "--new-knob", "7"])).new_knob == 7  # a flag overrides it


def test_a_new_fields_bad_value_is_the_same_line_everywhere(tmp_path):
    p = _parser()
    with pytest.raises(ConfigError, match=f"^{BAD} \\(see parallelisms demo --help\\)$"):
        p.parse_args(["--new-knob", "11"])
    with pytest.raises(ConfigError, match=f"^{BAD} \\(see parallelisms demo --help\\)$"):
        settings("demo", {"new_knob": 11}, p)
    run = tmp_path / "run.toml"
    run.write_text("[training]\nnew_knob = 11\n")
    with pytest.raises(ConfigError, match=f"^{CONFIG_FLAG} '.*run.toml': {BAD}"):
        p.parse_args([CONFIG_FLAG, str(run)])


TABLES = {"training": TRAIN_FLAGS, "model": MODEL_SOURCE_FLAGS + MODEL_FLAGS, "data": DATA_FLAGS + EVAL_FLAGS,
          "schedule": SCHEDULE_FLAGS, "run files": RUN_FILE_FLAGS, "launch": LAUNCH_FLAGS,
          "checkpoints": CHECKPOINT_FLAGS, "train's own": TRAIN_RUN_FLAGS, "data-parallel degrees": DP_FLAGS,
          "verify's own": VERIFY_RUN_FLAGS, "pricing": PRICING_FLAGS, "plan's own": PLAN_FLAGS,
          "dryrun's own": DRYRUN_FLAGS, "simulate's": SIMULATE_FLAGS}
VERB_TABLES = [*(("train", t) for t in list(TABLES)[:9]), ("verify", "verify's own"),
               ("verify", "data-parallel degrees"),
               *((verb, t) for verb in ("estimate", "plan", "dryrun") for t in ("pricing", "data-parallel degrees")),
               ("plan", "plan's own"), ("dryrun", "dryrun's own"), ("simulate", "simulate's")]
REQUIRED = {"plan": {"gpus": 8}, "simulate": {"schedule": "1f1b", "pp": 2, "microbatches": 4}}


@pytest.mark.parametrize("verb, table", VERB_TABLES)
def test_every_generated_flag_of_a_verb_is_a_keyword_and_a_file_key(verb, table):
    parser = verb_parser(verb)
    keywords = settings(verb, REQUIRED.get(verb, {}))
    in_file = {key for section in sections(parser).values() for key in section}
    for flag in TABLES[table]:
        assert flag.name in parser._option_string_actions, flag.name
        assert flag.dest in keywords and flag.dest in in_file, flag.dest


@pytest.mark.parametrize("table, config", [(DP_FLAGS, DataParallelDegrees), (PRICING_FLAGS, Pricing),
                                           (PLAN_FLAGS, PlanRun), (DRYRUN_FLAGS, DryrunOptions),
                                           (SIMULATE_FLAGS, SimulateRun)])
def test_each_table_fills_its_dataclass(table, config):
    fields = {f.name: f for f in dataclasses.fields(config)}
    assert {f.field for f in table} <= set(fields)
    for flag in table:  # a field without a default is a required flag, and only such a field
        assert flag.required == (fields[flag.field].default is dataclasses.MISSING), flag.field


def test_plan_and_simulate_runs_are_the_same_from_the_command_line_and_the_api():
    argv = ["--gpus", "16", "--top", "2", "--tp", "2", "--hardware", "a100", "--kernels", "fused", "--fp8"]
    from_cli = plan_run(verb_parser("plan").parse_args(argv))
    from_api = plan_run(settings("plan", dict(gpus=16, top=2, tp=2, hardware="a100", kernels="fused", fp8=True)))
    assert from_cli == from_api and isinstance(from_cli, PlanRun)
    assert (from_cli.gpus, from_cli.top, from_cli.fixed.tp, from_cli.fixed.dp, from_cli.kernels, from_cli.fp8) == (
        16, 2, 2, None, "fused", True)
    assert from_cli.hardware.name.startswith("A100") and from_cli.base.mixed_precision == "bf16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        from_cli.gpus = 8
    argv = ["--schedule", "zb-h1", "--pp", "4", "--microbatches", "8", "--tw", "0.5"]
    from_cli = simulate_run(verb_parser("simulate").parse_args(argv))
    assert from_cli == simulate_run(settings("simulate", dict(schedule="zb-h1", pp=4, microbatches=8, tw=0.5)))
    assert from_cli == SimulateRun("zb-h1", 4, 8, tw=0.5) and from_cli.times.t_w == 0.5
    pricing = estimate_run(settings("estimate", dict(attention="fused-softmax", kernels="fused")))
    assert (pricing.attention, pricing.kernels, pricing.fp8) == ("fused-softmax", "fused", False)


def test_the_data_and_run_file_flags_cover_their_configs():
    assert {f.field for f in DATA_FLAGS + EVAL_FLAGS} == {f.name for f in dataclasses.fields(DataConfig)} - {
        "vocab_sweep"}  # verify's own: every token id in its batches
    assert {f.field for f in RUN_FILE_FLAGS} == {f.name for f in dataclasses.fields(RunFiles)}
    given = settings("train", dict(data="corpus.txt", data_dtype="uint32", eval_split=0.1, eval_every=2, warmup=3,
                                   lr_schedule="cosine", min_lr=1e-4, metrics="m.jsonl", export_hf="hf",
                                   export_dtype="same"))
    assert data_settings(given) == {"data": DataConfig(path="corpus.txt", bin_dtype="uint32", eval_split=0.1,
                                                       eval_every=2), "warmup": 3, "lr_schedule": "cosine",
                                    "min_lr": 1e-4}
    assert run_files(given) == RunFiles(metrics="m.jsonl", export_hf="hf", export_dtype="same")
