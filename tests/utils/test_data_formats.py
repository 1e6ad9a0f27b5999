"""One reader for every data key: the same rows as parquet, JSON lines and a `datasets` save_to_disk folder give the
same dataset items; each format's bad rows and lines are named with the file and the row."""

import json

import pandas as pd
import pyarrow as pa
import pytest
import torch

from omegaconf import OmegaConf

from hflow.trainer.config import default_config
from hflow.utils.dataset import RLHFDataset
from hflow.utils.dataset.config import SFTDataConfig, check_data
from hflow.utils.dataset.sources import read_table
from hflow.utils.dataset.supervised import SFTDataset
from hflow.utils.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from hflow.tasks.tiny_models import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def rows(count=6, source="hflow/arithmetic"):
    """Prompt rows with every shape a column takes: text, a list of structs, nested structs, a list of ints."""
    return [{"data_source": source,
             "prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"What is {i} + 2?"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
             "extra_info": {"split": "train", "index": 100 + i, "tags": [i, i + 1]}}
            for i in range(count)]


def write_parquet(path, records):
    pd.DataFrame(records).to_parquet(path, index=False)
    return str(path)


def write_jsonl(path, records, blank_lines=False):
    with open(path, "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
            if blank_lines:
                handle.write("\n")
    return str(path)


def write_saved_dataset(folder, records, shards=1):
    """The folder `datasets.Dataset.save_to_disk` writes (datasets is not installed here): Arrow IPC stream shards
    named data-XXXXX-of-YYYYY.arrow, state.json listing them, dataset_info.json with the features."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(records)
    per_shard = -(-len(records) // shards)
    names = []
    for shard in range(shards):
        name = f"data-{shard:05d}-of-{shards:05d}.arrow"
        with pa.ipc.new_stream(str(folder / name), table.schema) as writer:
            writer.write_table(table.slice(shard * per_shard, per_shard), max_chunksize=2)
        names.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": names, "_fingerprint": "0", "_format_columns": None,
                                                   "_format_kwargs": {}, "_format_type": None,
                                                   "_output_all_columns": False, "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    return str(folder)


def write_saved_dataset_dict(folder, splits):
    folder.mkdir(parents=True)
    for split, records in splits.items():
        write_saved_dataset(folder / split, records)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    return str(folder)


def data_config(**overrides):
    data = default_config().data
    for key, value in {"max_prompt_length": 64, "filter_overlong_prompts": False, **overrides}.items():
        data[key] = value
    return data


def same_items(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key] and type(a[key]) is type(b[key]), (key, a[key], b[key])


def three_forms(tmp_path, records):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return {"parquet": write_parquet(tmp_path / "rows.parquet", records),
            "jsonl": write_jsonl(tmp_path / "rows.jsonl", records, blank_lines=True),
            "save_to_disk": write_saved_dataset(tmp_path / "rows_saved", records, shards=2)}


def test_the_same_rows_in_three_formats_give_identical_items(tokenizer, tmp_path):
    records = rows()
    datasets = {form: RLHFDataset(path, tokenizer, data_config(return_raw_chat=True))
                for form, path in three_forms(tmp_path, records).items()}
    assert {len(d) for d in datasets.values()} == {len(records)}
    for index in range(len(records)):
        items = [d[index] for d in datasets.values()]
        for other in items[1:]:
            same_items(items[0], other)
        # nested dicts and lists come through intact, not flattened or stringified
        assert items[0]["reward_model"] == records[index]["reward_model"]
        assert items[0]["extra_info"] == records[index]["extra_info"]
        assert items[0]["raw_prompt"] == records[index]["prompt"]
    tables = [read_table(path, "data.train_files") for path in three_forms(tmp_path / "again", records).values()]
    for other in tables[1:]:  # the same records (pandas writes large_string and "element" list fields: same values)
        assert other.to_pylist() == tables[0].to_pylist() == records
        assert pa.types.is_struct(other.schema.field("reward_model").type)
        assert pa.types.is_list(other.schema.field("extra_info").type.field("tags").type)


def test_a_mix_of_formats_reads_every_file_in_order(tokenizer, tmp_path):
    paths = [write_parquet(tmp_path / "a.parquet", rows(2, "a")), write_jsonl(tmp_path / "b.jsonl", rows(3, "b")),
             write_saved_dataset(tmp_path / "c", rows(1, "c"))]
    dataset = RLHFDataset(paths, tokenizer, data_config())
    assert [dataset[i]["data_source"] for i in range(len(dataset))] == ["a", "a", "b", "b", "b", "c"]


def test_a_dataset_dict_folder_reads_the_configured_split(tokenizer, tmp_path):
    folder = write_saved_dataset_dict(tmp_path / "dd", {"train": rows(4, "tr"), "test": rows(2, "te")})
    train = RLHFDataset(folder, tokenizer, data_config())
    val = RLHFDataset(folder, tokenizer, data_config(), files_key="data.val_files")
    assert len(train) == 4 and train[0]["data_source"] == "tr"
    assert len(val) == 2 and val[0]["data_source"] == "te"  # data.val_split defaults to TRL's "test"
    with pytest.raises(ConfigError, match=r"data.train_files: .*dd is a DatasetDict with splits \['train', 'test'\], "
                                          r"without 'validation' \(data.train_split\)"):
        RLHFDataset(folder, tokenizer, data_config(train_split="validation"))


def test_sft_reads_json_lines_as_it_reads_parquet(tokenizer, tmp_path):
    chats = [{"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": str(i)}]}
             for i in range(3)]
    sft = OmegaConf.structured(SFTDataConfig)
    a = SFTDataset(write_parquet(tmp_path / "s.parquet", chats), tokenizer, sft)
    b = SFTDataset(write_jsonl(tmp_path / "s.jsonl", chats), tokenizer, sft)
    c = SFTDataset(write_saved_dataset(tmp_path / "s_saved", chats), tokenizer, sft)
    assert a.rows == b.rows == c.rows and len(a.rows) == 3


# ---- bad input -----------------------------------------------------------------------------------


def test_a_bad_json_line_names_the_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in rows(3)]
    lines.insert(2, '{"prompt": [oops]}')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"data.train_files: {path} line 3: not valid JSON"):
        RLHFDataset(str(path), tokenizer, data_config())
    path.write_text(json.dumps(rows(1)[0]) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=rf"{path} line 2: a JSON list, not an object"):
        RLHFDataset(str(path), tokenizer, data_config())


@pytest.mark.parametrize("form", ["parquet", "jsonl", "save_to_disk"])
def test_a_bad_row_is_named_with_its_file_and_row_in_every_format(tokenizer, tmp_path, form):
    records = rows(5)
    records[3]["prompt"] = [{"role": "user", "content": None}]
    path = three_forms(tmp_path, records)[form]
    where = {"parquet": "row 3", "jsonl": r"row 3 \(line 7\)", "save_to_disk": "row 3"}[form]  # blank lines between
    with pytest.raises(DataError, match=rf"data.train_files: {path} {where}: a message of column 'prompt' has no "
                                        r"'content' \(null\)"):
        RLHFDataset(path, tokenizer, data_config())
    records[3]["prompt"] = []
    path = three_forms(tmp_path / "empty", records)[form]
    with pytest.raises(DataError, match=rf"{path} {where}: column 'prompt' holds no messages"):
        RLHFDataset(path, tokenizer, data_config())


def test_unknown_formats_are_refused_naming_the_key_and_the_formats(tokenizer, tmp_path):
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt\nhi\n")
    message = r"data.train_files: .*rows.csv' has the extension '.csv', which hflow does not read; " \
              r"data.train_files takes parquet files \(.parquet\), JSON lines"
    with pytest.raises(ConfigError, match=message):
        RLHFDataset(str(csv), tokenizer, data_config())
    data = data_config(train_files=str(csv), val_files=write_parquet(tmp_path / "v.parquet", rows(2)))
    with pytest.raises(ConfigError, match=message):
        check_data(data)  # preflight's check, before any worker starts
    folder = tmp_path / "plain_folder"
    folder.mkdir()
    data.train_files = str(folder)
    with pytest.raises(ConfigError, match=r"is a folder but not one written by datasets' save_to_disk"):
        check_data(data)


@pytest.mark.parametrize("form", ["jsonl", "save_to_disk"])
def test_preflight_reads_the_data_sources_of_every_format(tmp_path, form):
    from hflow.trainer.preflight import check_reward_sources

    path = three_forms(tmp_path, rows(3, source="nobody/knows"))[form]
    config = default_config()
    config.data.train_files = path
    with pytest.raises(ConfigError, match=rf"data.train_files: {path} has data_source 'nobody/knows', which has no "
                                          "built-in scorer"):
        check_reward_sources(config)
    config.data.train_files = three_forms(tmp_path / "known", rows(3))[form]
    check_reward_sources(config)


def test_ptx_text_reads_every_format(tokenizer, tmp_path):
    from hflow.utils.dataset.ptx_dataset import PtxSampler

    texts = [{"text": f"the number {i} comes after {i - 1}"} for i in range(5)]
    files = [write_parquet(tmp_path / "t.parquet", texts), write_jsonl(tmp_path / "t.jsonl", texts),
             write_saved_dataset_dict(tmp_path / "t_saved", {"train": texts})]
    samplers = [PtxSampler(path, "text", tokenizer, batch_size=3, max_length=16, seed=1) for path in files]
    assert [s.texts.to_pylist() for s in samplers] == [[t["text"] for t in texts]] * 3
    batches = [s.next_batch()["input_ids"] for s in samplers]
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[0], batches[2])
