"""The parallelisms' descriptors (parallelisms.parallel.registry) are what the configs, the command line and the
support table read: every layout option is one descriptor's, every flag of the layout is generated from one,
every feature's row switches that feature on, every transform exists, and the options' values are the enums'."""

import dataclasses
import importlib

import pytest

from parallelisms.cli import build_parser
from parallelisms.config import ParallelConfig, TrainConfig
from parallelisms.errors import ConfigError
from parallelisms.mesh import ParallelDims
from parallelisms.options import FsdpStyle, Recompute, Schedule
from parallelisms.parallel.pipeline.schedules import SCHEDULES
from parallelisms.parallel.registry import OPTIONS, PARALLELISMS, module_swaps, parallel_config
from parallelisms.support import FLAGS, features

from _layouts import layout_with

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)


def test_every_layout_option_is_one_descriptors():
    owned = [o.field for p in PARALLELISMS.values() for o in p.options]
    assert len(owned) == len(set(owned))
    assert set(owned) == {f.name for f in dataclasses.fields(ParallelConfig)} - {"dims"}


def test_every_descriptor_dimension_is_a_mesh_dimension_and_every_transform_exists():
    mesh = {f.name for f in dataclasses.fields(ParallelDims)}
    for p in PARALLELISMS.values():
        assert p.dim is None or p.dim in mesh, p.name
        module, function = p.transform.split(":")
        assert callable(getattr(importlib.import_module(module), function)), p.transform


def test_parallelize_applies_the_module_swaps_in_the_registrys_order():
    from parallelisms.parallel import context, ep_balance, recompute, tensor_plan

    assert module_swaps() == [tensor_plan.tensor_parallel_swap, context.context_parallel_swap,
                              ep_balance.expert_parallel_swap, recompute.recompute_swap]
    swapping = [p.name for p in PARALLELISMS.values() if p.module_swap]
    assert swapping == ["tensor", "context", "expert", "recompute"]


def test_the_layout_flags_are_the_descriptors_options():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    dests = {a.dest: a for a in train._actions}
    for option in OPTIONS.values():
        action = dests[option.dest]
        assert option.name in action.option_strings
        if option.choices:  # the enum's values, listed in --help
            assert action.metavar == "{" + ",".join(option.choices) + "}"


@pytest.mark.parametrize("name", list(FLAGS))
def test_each_features_row_switches_it_on(name):
    model, train, parallel = layout_with([name])
    assert name in features(model, train, parallel)


def test_valid_strings_become_members_and_others_are_refused_by_flag():
    parallel = ParallelConfig(recompute="full", fsdp_style="per_param", schedule="zb-v")
    assert parallel.recompute is Recompute.FULL and parallel.fsdp_style is FsdpStyle.PER_PARAM
    assert parallel.schedule is Schedule.ZB_V and f"{parallel.schedule}" == "zb-v"
    assert TrainConfig(dtype="float64").dtype == "float64"  # a member is its string
    assert set(Schedule) == set(SCHEDULES)
    with pytest.raises(ConfigError, match="unknown --recompute 'some'; choose one of none, selective, full"):
        from parallelisms.support import validate_layout
        model, train, _ = layout_with([])
        validate_layout(model, train, ParallelConfig(recompute="some"))
    with pytest.raises(ConfigError, match="unknown layout option"):
        parallel_config(ParallelDims(), recompte="full")
