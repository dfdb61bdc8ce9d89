"""The support table is the one place that says which features cannot run together: validation reads it
(every listed pair fails before launch with one line naming both flags and the reason), and the README's
list is generated from it."""

import pathlib

import pytest

from parallelisms.errors import ConfigError
from parallelisms.parallel.registry import PARALLELISMS, ROWS
from parallelisms.support import (UNSUPPORTED, check_pairs, feature_rows_markdown, features, not_supported_markdown,
                                  validate_layout)

from _layouts import layout_with

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)

@pytest.mark.parametrize("pair", sorted(sorted(p) for p in UNSUPPORTED), ids="+".join)
def test_every_unsupported_pair_fails_before_launch_with_its_reason(pair):
    with pytest.raises(ConfigError) as exc:
        check_pairs(pair)
    assert UNSUPPORTED[frozenset(pair)] in str(exc.value) and "\n" not in str(exc.value)
    model, train, parallel = layout_with(pair)
    assert set(pair) <= set(features(model, train, parallel))
    with pytest.raises(ConfigError):
        validate_layout(model, train, parallel)


def test_supported_pairs_pass_the_table():
    """A few pairs the runtime verifies (see the equivalence tests) are not in the table."""
    for pair in (("tp", "interleaved"), ("zero1", "pp"), ("recompute-full", "zb-v"), ("ring", "zero3"),
                 ("moe", "zero3"), ("sp", "1f1b"), ("fsdp-hybrid_shard", "tp"), ("sp", "ring"), ("sp", "ulysses"),
                 ("moe", "sp"), ("moe", "ring"), ("moe", "ulysses")):
        check_pairs(list(pair))


def test_readme_lists_exactly_the_table():
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    start = readme.index("<!-- support table: generated")
    block = readme[readme.index("\n", start) + 1:readme.index("<!-- end of support table -->")].strip()
    assert block == not_supported_markdown(), "regenerate README's list from parallelisms.support.not_supported_markdown()"


def test_readme_feature_table_opens_with_the_parallelisms_rows():
    """Every descriptor has one row (its page exists), and README's feature table lists them first, in the
    registry's order, as :func:`feature_rows_markdown` writes them; the rows after them are not parallelisms."""
    root = pathlib.Path(__file__).parents[1]
    assert list(ROWS) == list(PARALLELISMS)
    assert all((root / row.page).is_file() for row in ROWS.values())
    readme = (root / "README.md").read_text()
    start = readme.index("| feature | state | what it covers | page |\n|---|---|---|---|\n")
    table = readme[start:].split("\n")[2:2 + len(ROWS)]
    assert "\n".join(table) == feature_rows_markdown(), \
        "regenerate README's first feature rows from parallelisms.support.feature_rows_markdown()"
