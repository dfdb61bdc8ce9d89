"""``scripts/mutants.py`` plants each bug by replacing a line of today's source: every planted line still
exists exactly once and every mutated file compiles, so the mutation check runs against the code as it is
(a refactor that moves a line fails here, not an hour into the check)."""

import importlib.util
import pathlib
import sys

import pytest

pytestmark = pytest.mark.fast  # reads and compiles text: no process starts (tests/conftest.py)

REPO = pathlib.Path(__file__).resolve().parent.parent


def _mutants_module():
    spec = importlib.util.spec_from_file_location("mutants_script", REPO / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


MUTANTS = _mutants_module()


@pytest.mark.parametrize("mutant", MUTANTS.MUTANTS, ids=lambda m: m.id)
def test_every_mutant_patches_todays_source_once_and_compiles(mutant):
    texts = MUTANTS.patched_sources(mutant, REPO / "src")  # exits naming the mutant when a line has moved
    assert texts and all(text != path.read_text() for path, text in texts.items())
