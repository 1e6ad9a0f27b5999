"""`data.mixture`: rows drawn from each file by its weight, seeded, resumable through the loader's state, its weights
checked naming the key; the per-file counts a step reports."""

import numpy as np
import pytest

from hflow.protocol import DataProto
from hflow.trainer.ppo.metric_utils import compute_mixture_metrics
from hflow.utils.dataset import RLHFDataset, collate_fn, create_train_dataloader
from hflow.utils.dataset.config import check_data
from hflow.utils.dataset.dataloader import MixtureSampler
from hflow.utils.errors import ConfigError
from tests.utils.test_data_formats import data_config, rows, write_jsonl, write_parquet, write_saved_dataset


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from hflow.tasks.tiny_models import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def files_of(order, item_files):
    return np.asarray(item_files)[np.asarray(order)]


def test_draws_follow_the_weights_whatever_the_file_sizes():
    item_files = [0] * 10 + [1] * 200 + [2] * 40  # a small file weighted up, a large one weighted down
    weights = [5.0, 3.0, 2.0]
    sampler = MixtureSampler(item_files, weights, shuffle=True, seed=7)
    drawn = np.concatenate([files_of(sampler.order(epoch), item_files) for epoch in range(40)])
    shares = np.bincount(drawn, minlength=3) / len(drawn)
    assert len(drawn) == 40 * 250
    np.testing.assert_allclose(shares, np.array(weights) / sum(weights), atol=0.015)
    # every sample of the small file is used before any repeats (its draws walk its samples)
    first = files_of(sampler.order(0), item_files)
    small = np.asarray(sampler.order(0))[first == 0]
    assert len(small) > 10 and sorted(small[:10].tolist()) == list(range(10))


def test_same_seed_same_order_and_another_seed_another():
    item_files = [0] * 30 + [1] * 30
    a = MixtureSampler(item_files, [1, 3], seed=1)
    assert a.order(0) == MixtureSampler(item_files, [1, 3], seed=1).order(0)
    assert a.order(0) != a.order(1)  # each epoch its own draws
    assert a.order(0) != MixtureSampler(item_files, [1, 3], seed=2).order(0)


def test_the_loader_resumes_a_mixture_at_the_next_batch(tokenizer, tmp_path):
    paths = [write_parquet(tmp_path / "a.parquet", rows(4, "a")), write_jsonl(tmp_path / "b.jsonl", rows(12, "b")),
             write_saved_dataset(tmp_path / "c", rows(8, "c"))]
    config = data_config(train_files=paths, mixture=[1, 1, 2], train_batch_size=4)
    dataset = RLHFDataset(paths, tokenizer, config)

    def sources(batch):
        return list(zip(batch["data_source"], batch["index"], batch["data_file"]))

    full = create_train_dataloader(dataset, config, collate_fn)
    uninterrupted = [sources(b) for epoch in range(2) for b in full]  # across an epoch boundary
    assert len(uninterrupted) == 12
    first = create_train_dataloader(dataset, config, collate_fn)
    taken = [sources(b) for b in first] + [sources(next(iter(first)))]  # an epoch of 6 batches, then one more
    assert taken == uninterrupted[:7]
    state = first.state_dict()
    resumed = create_train_dataloader(RLHFDataset(paths, tokenizer, config), config, collate_fn)
    resumed.load_state_dict(state)
    rest = [sources(b) for epoch in range(resumed.epoch, 2) for b in resumed]
    assert rest == uninterrupted[7:]
    files = {i: name for name, _, i in sum(uninterrupted, [])}
    assert files == {0: "a", 1: "b", 2: "c"}  # each item names its file
    other = data_config(train_files=paths, mixture=[1, 1, 3], train_batch_size=4)
    with pytest.raises(ConfigError, match=r"mixture \[1.0, 1.0, 2.0\] → \[1.0, 1.0, 3.0\]"):
        create_train_dataloader(dataset, other, collate_fn).load_state_dict(state)


def test_a_step_reports_the_prompts_drawn_from_each_file():
    batch = DataProto.from_single_dict({"data_file": np.array([0, 0, 2, 2, 2, 2], dtype=object),
                                        "uid": np.array(["u", "u", "v", "v", "w", "w"], dtype=object)})
    metrics = compute_mixture_metrics(batch, ["/d/a.parquet", "/d/b.jsonl", "/d/saved/"])
    assert metrics == {"data/rows_from/0_a.parquet": 1.0, "data/rows_from/1_b.jsonl": 0.0,
                       "data/rows_from/2_saved": 2.0}


@pytest.mark.parametrize("mixture, message", [
    ([1, 2], r"data.mixture has 2 weights but data.train_files has 3 files"),
    ([1, 0, 2], r"data.mixture\[1\]=0.0 \(for .*b.jsonl\): every weight must be a positive finite number"),
    ([1, -1, 2], r"data.mixture\[1\]=-1.0"),
    ("heavy", r"data.mixture='heavy': give a list of numbers"),
])
def test_bad_weights_are_refused_naming_the_key(tmp_path, mixture, message):
    paths = [write_parquet(tmp_path / "a.parquet", rows(2)), write_jsonl(tmp_path / "b.jsonl", rows(2)),
             write_parquet(tmp_path / "c.parquet", rows(2))]
    with pytest.raises(ConfigError, match=message):
        check_data(data_config(train_files=paths, val_files=paths[0], mixture=mixture))
