"""The composition table (docs/composition.md) is what the checks say, and its "tested" cells name tests
that exist."""

import re
from pathlib import Path

import pytest

from hflow.cli import composition

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return composition.cells(composition.write_assets(tmp_path_factory.mktemp("composition")))


def test_the_committed_table_is_what_the_checks_say(table):
    committed = composition.TABLE.read_text()
    assert committed == composition.render(table), (
        "docs/composition.md disagrees with preflight: run python -m hflow.cli.composition --write and read the diff")


def test_every_tested_cell_names_a_test_that_exists_and_a_pair_preflight_accepts(table):
    for pair, test in composition.TESTED.items():
        assert all(name in {axis.name for axis in composition.AXES} for name in pair), pair
        path, _, name = test.partition("::")
        source = (REPO / path).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{test} is not a test of {path}"
        assert table[pair].startswith("tested"), (sorted(pair), table[pair])


def test_each_axis_turns_its_feature_on_and_works_alone(table):
    """An axis that preflight refused alone would leave its whole row unchecked."""
    refused = {name: table[frozenset({name})] for name in (axis.name for axis in composition.AXES)
               if not table[frozenset({name})].startswith("works")}
    assert refused == {"async-colocate": refused.get("async-colocate")}, refused
    assert "placement=split" in refused["async-colocate"]  # a reason, not an accident of the base config
