"""examples/smollm2_arith/make_data.py: determinism, disjoint splits, hflow's schema, and that the
built-in arithmetic scorer accepts the reference answer in the format the prompt asks for. Fast: no
model is downloaded or converted."""

import importlib.util
import re
from pathlib import Path

import pandas as pd
import pytest

from hflow.reward.score import default_compute_score

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2_arith"


@pytest.fixture(scope="module")
def make_data():
    spec = importlib.util.spec_from_file_location("smollm2_arith_make_data", EXAMPLE / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def written(make_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2_arith")
    paths = make_data.main(["--out", str(out), "--train", "600", "--test", "90", "--seed", "3"])
    assert sorted(p.name for p in paths) == ["test.parquet", "train.parquet"]
    return pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "test.parquet")


def triples(frame):
    return {(e["op"], e["a"], e["b"]) for e in frame["extra_info"]}


def test_deterministic(make_data, written):
    train, test = make_data.build(600, 90, seed=3)
    pd.testing.assert_frame_equal(train, written[0])
    pd.testing.assert_frame_equal(test, written[1])
    other_train, _ = make_data.build(600, 90, seed=4)
    assert list(other_train["extra_info"]) != list(train["extra_info"])


def test_sizes_and_disjoint_splits(written):
    train, test = written
    assert len(train) == 600 and len(test) == 90
    # each (op, a, b) appears once, and in one split only; so does each problem text
    assert len(triples(train)) == 600 and len(triples(test)) == 90
    assert not triples(train) & triples(test)
    train_text = {p[0]["content"] for p in train["prompt"]}
    assert not train_text & {p[0]["content"] for p in test["prompt"]}
    # all three operations in both splits, balanced in the test split
    assert test["extra_info"].map(lambda e: e["op"]).value_counts().to_dict() == {"add": 30, "sub": 30, "mul": 30}
    assert set(train["extra_info"].map(lambda e: e["op"])) == {"add", "sub", "mul"}


def test_schema(make_data, written):
    for split, frame in zip(("train", "test"), written):
        assert list(frame.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        assert set(frame["data_source"]) == {"hflow/arithmetic"}
        assert set(frame["ability"]) == {"math"}
        assert [e["index"] for e in frame["extra_info"]] == list(range(len(frame)))
        for prompt, reward, extra in zip(frame["prompt"], frame["reward_model"], frame["extra_info"]):
            assert len(prompt) == 1 and prompt[0]["role"] == "user"
            assert prompt[0]["content"] == extra["question"] + " " + make_data.INSTRUCTION
            assert reward["style"] == "rule"
            assert reward["ground_truth"] == str(make_data.answer(extra["op"], extra["a"], extra["b"]))
            assert int(reward["ground_truth"]) >= 0
            assert extra["split"] == split
            # the numbers of the problem are in its text
            numbers = [int(n) for n in re.findall(r"\d+", extra["question"])]
            assert sorted(numbers) == sorted([extra["a"], extra["b"]])


def test_builtin_scorer_accepts_the_requested_format(make_data, written):
    # the instruction asks for "Answer: <number>"; the reference answer in that form scores 1.0
    assert "'Answer: <number>'" in make_data.INSTRUCTION
    for frame in written:
        for reward, extra in list(zip(frame["reward_model"], frame["extra_info"]))[:50]:
            truth = reward["ground_truth"]
            a, b = extra["a"], extra["b"]
            symbol = {"add": "+", "sub": "-", "mul": "*"}[extra["op"]]
            good = f"{a} {symbol} {b} = {truth}. Answer: {truth}"
            assert default_compute_score("hflow/arithmetic", good, truth) == 1.0
            wrong = f"Answer: {int(truth) + 1}"
            assert default_compute_score("hflow/arithmetic", wrong, truth) == 0.0
