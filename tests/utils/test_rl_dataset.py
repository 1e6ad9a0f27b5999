"""RLHFDataset (parquet → left-padded prompts), collate_fn, and the resumable data loader."""

import logging

import numpy as np
import pandas as pd
import pytest
import torch

from hflow.trainer.config import default_config
from hflow.protocol import DataProto
from hflow.utils.dataset import (
    ResumableDataLoader,
    RLHFDataset,
    SeededEpochSampler,
    collate_fn,
    create_rl_sampler,
    create_train_dataloader,
)

QUESTIONS = [
    "What is 2 + 3?",
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "What is 6 * 7?",
    "Please answer the question: what is 81 / 9? Let's think step by step and add the numbers first.",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from hflow.tasks.tiny_models import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def rows(questions=QUESTIONS, split="train"):
    return [
        {
            "data_source": "hflow/arithmetic",
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"split": split, "index": 100 + i},
        }
        for i, question in enumerate(questions)
    ]


def write(path, records):
    pd.DataFrame(records).to_parquet(path, index=False)
    return str(path)


def templated_ids(tokenizer, question, template=None):
    kwargs = {"chat_template": template} if template else {}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False, **kwargs
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def config(**overrides):
    """The `data` section at the schema's defaults, with this module's settings and `overrides`."""
    data = default_config().data
    for key, value in {"max_prompt_length": 64, "filter_overlong_prompts": False, **overrides}.items():
        data[key] = value
    return data


# ---- items ---------------------------------------------------------------------------------------


def test_item_is_left_padded_templated_prompt(tokenizer, tmp_path):
    dataset = RLHFDataset(write(tmp_path / "train.parquet", rows()), tokenizer, config(return_raw_chat=True))
    assert len(dataset) == len(QUESTIONS)
    item = dataset[1]
    ids = templated_ids(tokenizer, QUESTIONS[1])
    pad = 64 - len(ids)

    assert item["input_ids"].shape == item["attention_mask"].shape == item["position_ids"].shape == (64,)
    assert item["input_ids"].tolist() == [tokenizer.pad_token_id] * pad + ids
    assert item["attention_mask"].tolist() == [0] * pad + [1] * len(ids)
    assert item["position_ids"].tolist() == [0] * pad + list(range(len(ids)))
    assert item["raw_prompt_ids"] == ids
    assert item["raw_prompt"] == [{"role": "user", "content": QUESTIONS[1]}]
    assert item["data_source"] == "hflow/arithmetic"
    assert item["reward_model"] == {"style": "rule", "ground_truth": "1"}
    assert item["ability"] == "math"
    assert item["extra_info"]["split"] == "train"
    assert item["index"] == 101  # from extra_info.index
    assert "prompt" not in item


def test_raw_prompt_only_on_request_and_index_defaults_to_row(tokenizer, tmp_path):
    records = rows()
    for record in records:
        record.pop("extra_info")
    dataset = RLHFDataset(write(tmp_path / "train.parquet", records), tokenizer, config())
    assert "raw_prompt" not in dataset[0]
    assert [dataset[i]["index"] for i in range(len(dataset))] == [0, 1, 2, 3]


def test_several_files_and_home_expansion(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path / "a.parquet", rows(QUESTIONS[:2]))
    write(tmp_path / "b.parquet", rows(QUESTIONS[2:], split="test"))
    dataset = RLHFDataset(["~/a.parquet", "~/b.parquet"], tokenizer, config())
    assert len(dataset) == 4
    assert dataset[3]["raw_prompt_ids"] == templated_ids(tokenizer, QUESTIONS[3])
    assert dataset[3]["extra_info"]["split"] == "test"


def test_chat_template_override(tokenizer, tmp_path):
    template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    dataset = RLHFDataset(write(tmp_path / "t.parquet", rows()), tokenizer, config(chat_template=template))
    assert dataset[0]["raw_prompt_ids"] == templated_ids(tokenizer, QUESTIONS[0], template)
    assert tokenizer.decode(dataset[0]["raw_prompt_ids"]) == f"Q: {QUESTIONS[0]}\nA:"


# ---- errors --------------------------------------------------------------------------------------


def test_missing_file_names_file_and_key(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.val_files.*nope\.parquet"):
        RLHFDataset(str(tmp_path / "nope.parquet"), tokenizer, config(), files_key="data.val_files")
    with pytest.raises(ValueError, match=r"data\.train_files is not set"):
        RLHFDataset(None, tokenizer, config())


@pytest.mark.parametrize(
    ("drop", "change", "message"),
    [
        ("prompt", None, r"no prompt column 'prompt' \(data\.prompt_key\)"),
        ("data_source", None, r"no column 'data_source' \(data\.reward_fn_key\)"),
        ("reward_model", None, r"no column 'reward_model'"),
        (None, ("reward_model", {"style": "rule"}), r"not a struct with 'ground_truth'"),
        (None, ("prompt", "What is 2 + 3?"), r"not chat messages"),
    ],
)
def test_schema_errors_name_the_column_and_file(tokenizer, tmp_path, drop, change, message):
    records = rows()
    for record in records:
        if drop:
            record.pop(drop)
        if change:
            record[change[0]] = change[1]
    path = write(tmp_path / "bad.parquet", records)
    with pytest.raises(ValueError, match=message) as error:
        RLHFDataset(path, tokenizer, config())
    assert "bad.parquet" in str(error.value)


def test_a_file_that_is_not_parquet_is_named_with_its_key(tokenizer, tmp_path):
    from hflow.utils.errors import DataError

    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"not parquet\n" * 10)
    with pytest.raises(DataError, match=r"data\.val_files: .*corrupt\.parquet is not a readable parquet file"):
        RLHFDataset(str(path), tokenizer, config(), files_key="data.val_files")


def test_bad_truncation_mode(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"data\.truncation='sideways'"):
        RLHFDataset(write(tmp_path / "t.parquet", rows()), tokenizer, config(truncation="sideways"))


# ---- long prompts --------------------------------------------------------------------------------


def test_truncation_error_names_file_row_and_length_at_load(tokenizer, tmp_path):
    """Without the filter, an overlong prompt stops the load (not the batch that holds it, mid-run)."""
    lengths = [len(templated_ids(tokenizer, question)) for question in QUESTIONS]
    limit = len(templated_ids(tokenizer, QUESTIONS[0]))
    first = next(i for i, length in enumerate(lengths) if length > limit)
    files = [write(tmp_path / "a.parquet", rows(QUESTIONS[:1])), write(tmp_path / "b.parquet", rows(QUESTIONS[1:]))]
    with pytest.raises(ValueError, match=rf"data\.train_files: .*b\.parquet row {first - 1}: the prompt of sample "
                                         rf"{first} is {lengths[first]} tokens.*max_prompt_length={limit} "):
        RLHFDataset(files, tokenizer, config(max_prompt_length=limit))
    dataset = RLHFDataset(files, tokenizer, config(max_prompt_length=limit, truncation="left"))
    assert len(dataset[first]["raw_prompt_ids"]) == limit


def test_a_prompt_without_content_or_that_the_template_fails_on_is_named(tokenizer, tmp_path):
    from hflow.utils.errors import ConfigError, DataError

    records = rows()
    records[2]["prompt"] = [{"role": "user", "content": None}]
    with pytest.raises(DataError, match=r"bad\.parquet row 2: a message of column 'prompt' has no 'content'"):
        RLHFDataset(write(tmp_path / "bad.parquet", records), tokenizer, config())
    failing = "{% if messages|length > 0 and messages[0]['content'] == '" + QUESTIONS[1] + "' %}" \
              "{{ raise_exception('no such question') }}{% endif %}{{ messages[0]['content'] }}"
    with pytest.raises(DataError, match=r"t\.parquet row 1: the chat template fails on its messages.*no such question"):
        RLHFDataset(write(tmp_path / "t.parquet", rows()), tokenizer, config(chat_template=failing))
    with pytest.raises(ConfigError, match=r"data\.chat_template is not a valid Jinja template"):
        RLHFDataset(write(tmp_path / "t.parquet", rows()), tokenizer, config(chat_template="{% if %}"))


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(tokenizer, tmp_path, mode):
    full = templated_ids(tokenizer, QUESTIONS[3])
    dataset = RLHFDataset(
        write(tmp_path / "t.parquet", rows()), tokenizer, config(max_prompt_length=9, truncation=mode)
    )
    expected = {"left": full[-9:], "right": full[:9], "middle": full[:4] + full[-5:]}[mode]
    item = dataset[3]
    assert item["raw_prompt_ids"] == expected
    assert item["input_ids"].tolist() == expected
    assert item["attention_mask"].tolist() == [1] * 9


def test_filter_overlong_prompts_drops_and_counts(tokenizer, tmp_path, caplog):
    lengths = [len(templated_ids(tokenizer, question)) for question in QUESTIONS]
    limit = sorted(lengths)[1]  # keeps the two shortest
    with caplog.at_level(logging.WARNING):
        dataset = RLHFDataset(
            write(tmp_path / "t.parquet", rows()),
            tokenizer,
            config(max_prompt_length=limit, filter_overlong_prompts=True),
        )
    assert dataset.num_filtered == 2 and len(dataset) == 2
    assert "dropped 2 of 4 prompts" in caplog.text
    assert sorted(len(dataset[i]["raw_prompt_ids"]) for i in range(2)) == sorted(lengths)[:2]
    with pytest.raises(ValueError, match="all 4 prompts are longer"):
        RLHFDataset(
            write(tmp_path / "t.parquet", rows()), tokenizer, config(max_prompt_length=2, filter_overlong_prompts=True)
        )


# ---- collate -------------------------------------------------------------------------------------


def test_collate_fn_builds_a_dataproto(tokenizer, tmp_path):
    dataset = RLHFDataset(write(tmp_path / "t.parquet", rows()), tokenizer, config(return_raw_chat=True))
    # Two prompts of identical token length: their raw_prompt_ids must stay one list per row.
    batch = collate_fn([dataset[0], dataset[0], dataset[2]])
    data = DataProto.from_single_dict(batch)
    assert len(data) == 3
    # only as wide as the longest prompt: the columns that are padding in every row are dropped
    longest = max(len(dataset[i]["raw_prompt_ids"]) for i in (0, 2))
    assert longest < 64 and data.batch["input_ids"].shape == (3, longest)
    assert data.batch["attention_mask"].any(dim=0).all()
    for row, i in enumerate((0, 0, 2)):
        item = dataset[i]
        assert torch.equal(data.batch["input_ids"][row], item["input_ids"][-longest:])
        assert torch.equal(data.batch["position_ids"][row], item["position_ids"][-longest:])
    assert set(data.batch.keys()) == {"input_ids", "attention_mask", "position_ids"}
    raw = data.non_tensor_batch["raw_prompt_ids"]
    assert raw.shape == (3,) and raw.dtype == object and raw[0] == dataset[0]["raw_prompt_ids"]
    assert data.non_tensor_batch["reward_model"][2]["ground_truth"] == "2"
    assert data.non_tensor_batch["raw_prompt"][1] == [{"role": "user", "content": QUESTIONS[0]}]
    assert data.non_tensor_batch["index"].tolist() == [100, 100, 102]


# ---- resumable loader ----------------------------------------------------------------------------


def list_collate(items):
    return list(items)


def make_loader(num_samples=10, batch_size=3, shuffle=True, seed=1, drop_last=True):
    sampler = SeededEpochSampler(num_samples, shuffle=shuffle, seed=seed)
    return ResumableDataLoader(
        list(range(num_samples)), batch_size, sampler=sampler, collate_fn=list_collate, drop_last=drop_last
    )


def run_epochs(loader, total_epochs, stop_after=None):
    """Batches from the loader's current epoch to `total_epochs`, like the trainer's loop; with
    `stop_after`, returns (batches, state) as saved right after that many batches."""
    batches = []
    for _ in range(loader.epoch, total_epochs):
        for batch in loader:
            batches.append(batch)
            if stop_after is not None and len(batches) == stop_after:
                return batches, loader.state_dict()
    return batches, None


def test_sampler_orders_are_seeded_per_epoch():
    sampler = SeededEpochSampler(10, shuffle=True, seed=3)
    assert sampler.order(0) == SeededEpochSampler(10, shuffle=True, seed=3).order(0)
    assert sampler.order(0) != sampler.order(1)
    assert sorted(sampler.order(1)) == list(range(10))
    assert SeededEpochSampler(5, shuffle=False).order(7) == [0, 1, 2, 3, 4]
    created = create_rl_sampler(config(shuffle=False, seed=9), list(range(4)))
    assert (created.shuffle, created.seed, len(created)) == (False, 9, 4)


def test_loader_epochs_drop_last_and_len():
    loader = make_loader()
    assert len(loader) == 3
    full, _ = run_epochs(loader, 3)
    assert len(full) == 9 and all(len(batch) == 3 for batch in full)
    assert full[:3] != full[3:6]  # reshuffled each epoch
    assert loader.epoch == 3
    sequential = make_loader(shuffle=False, drop_last=False)
    assert len(sequential) == 4
    assert run_epochs(sequential, 1)[0] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 6, 7, 8])
def test_resume_continues_the_uninterrupted_run(stop_after):
    """Mid-epoch (1, 2, 4, 7, 8) and exactly at epoch boundaries (3, 6)."""
    full, _ = run_epochs(make_loader(), 3)
    seen, state = run_epochs(make_loader(), 3, stop_after=stop_after)
    assert seen == full[:stop_after]

    resumed = make_loader()
    resumed.load_state_dict(state)
    assert resumed.epoch == stop_after // 3
    rest, _ = run_epochs(resumed, 3)
    assert rest == full[stop_after:]


def test_state_at_epoch_boundary_points_at_the_next_epoch():
    loader = make_loader()
    _, state = run_epochs(loader, 3, stop_after=3)
    assert (state["epoch"], state["batches_done"]) == (1, 0)


def test_resume_with_different_data_is_refused():
    _, state = run_epochs(make_loader(), 3, stop_after=2)
    with pytest.raises(ValueError, match=r"num_samples 10 → 12"):
        make_loader(num_samples=12).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed 1 → 2"):
        make_loader(seed=2).load_state_dict(state)


def test_loader_rejects_batch_larger_than_data():
    with pytest.raises(ValueError, match="batch size 11 gives no batch from 10 samples"):
        make_loader(batch_size=11)


def test_loader_over_dataset_with_worker_processes(tokenizer, tmp_path):
    dataset = RLHFDataset(write(tmp_path / "t.parquet", rows()), tokenizer, config())
    sampler = create_rl_sampler(config(shuffle=True, seed=1), dataset)
    in_process = ResumableDataLoader(dataset, 2, sampler=sampler)
    workers = ResumableDataLoader(dataset, 2, sampler=sampler, num_workers=1)
    expected = [DataProto.from_single_dict(batch) for batch in in_process]
    got = [DataProto.from_single_dict(batch) for batch in workers]
    assert len(got) == len(expected) == 2
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a.batch["input_ids"], b.batch["input_ids"])
        assert np.array_equal(a.non_tensor_batch["index"], b.non_tensor_batch["index"])
    assert workers.state_dict()["epoch"] == 1


def test_create_train_dataloader_from_config(tokenizer, tmp_path):
    dataset = RLHFDataset(write(tmp_path / "t.parquet", rows()), tokenizer, config())
    data_config = config(train_batch_size=3, shuffle=True, seed=5, dataloader_num_workers=0)
    loader = create_train_dataloader(dataset, data_config)
    assert len(loader) == 1  # 4 prompts, batches of 3, the incomplete one dropped
    [batch] = list(loader)
    expected = SeededEpochSampler(4, shuffle=True, seed=5).order(0)[:3]
    assert [dataset[i]["index"] for i in expected] == batch["index"].tolist()
