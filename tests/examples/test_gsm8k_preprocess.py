"""examples/data_preprocess/gsm8k.py on a tiny local GSM8K: schema, and that the trainer's dataset and
reward function accept its output."""

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

from hflow.trainer.config import default_config
from hflow.utils.dataset import RLHFDataset
from hflow.reward.score import default_compute_score

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data_preprocess" / "gsm8k.py"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

TRAIN = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs 1,200 dollars twice. Total?", "answer": "2 * 1200 = 2400\n#### 2,400"},
]
TEST = [{"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"}]


@pytest.fixture(scope="module")
def gsm8k():
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_converts_local_jsonl_folder(gsm8k, tmp_path):
    source = tmp_path / "grade_school_math"
    source.mkdir()
    write_jsonl(source / "train.jsonl", TRAIN)
    write_jsonl(source / "test.jsonl", TEST)
    (source / "README.md").write_text("ignored")
    written = gsm8k.main(["--input", str(source), "--local_dir", str(tmp_path / "out")])
    assert sorted(path.name for path in written) == ["test.parquet", "train.parquet"]

    train = pd.read_parquet(tmp_path / "out" / "train.parquet")
    assert list(train.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    row = train.iloc[1]
    assert row["data_source"] == "openai/gsm8k"
    assert list(row["prompt"]) == [{"role": "user", "content": TRAIN[1]["question"] + " " + INSTRUCTION}]
    assert row["ability"] == "math"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "2400"}
    assert row["extra_info"] == {
        "split": "train",
        "index": 1,
        "answer": TRAIN[1]["answer"],
        "question": TRAIN[1]["question"],
    }
    test = pd.read_parquet(tmp_path / "out" / "test.parquet")
    assert test.iloc[0]["extra_info"]["split"] == "test" and test.iloc[0]["reward_model"]["ground_truth"] == "42"


def test_output_feeds_the_dataset_and_the_reward(gsm8k, tmp_path):
    from hflow.tasks.tiny_models import build_tokenizer

    write_jsonl(tmp_path / "train.jsonl", TRAIN)
    gsm8k.main(["--input", str(tmp_path / "train.jsonl"), "--local_dir", str(tmp_path / "out")])
    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    data_config = default_config().data
    data_config.max_prompt_length = 128
    dataset = RLHFDataset(str(tmp_path / "out" / "train.parquet"), tokenizer, data_config)
    item = dataset[0]
    assert item["index"] == 0 and item["input_ids"].shape == (128,)
    assert INSTRUCTION in tokenizer.decode(item["raw_prompt_ids"])
    ground_truth = item["reward_model"]["ground_truth"]
    assert default_compute_score(item["data_source"], "3 + 4 = 7\n#### 7", ground_truth, item["extra_info"]) == 1.0


def test_parquet_input_and_errors(gsm8k, tmp_path):
    pd.DataFrame(TEST).to_parquet(tmp_path / "test-00000-of-00001.parquet")
    written = gsm8k.main(["--input", str(tmp_path / "test-00000-of-00001.parquet"), "--local_dir", str(tmp_path)])
    assert [path.name for path in written] == ["test.parquet"]

    write_jsonl(tmp_path / "extra.jsonl", TEST)
    with pytest.raises(ValueError, match="cannot tell the split of .*extra.jsonl"):
        gsm8k.main(["--input", str(tmp_path / "extra.jsonl"), "--local_dir", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="--input .*missing"):
        gsm8k.main(["--input", str(tmp_path / "missing"), "--local_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="without a '#### <number>'"):
        gsm8k.extract_answer("no marker here")
