"""`data.streaming=true`: rows read piece by piece through a shuffle buffer, filtered and checked as in memory, and a
loader resumed mid-epoch from its saved state hands out exactly the uninterrupted run's next batch."""

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hflow.utils.dataset import RLHFDataset
from hflow.utils.dataset.config import check_data
from hflow.utils.dataset.streaming import StreamedPrompts, StreamingDataLoader
from hflow.utils.errors import ConfigError, DataError
from tests.utils.test_data_formats import data_config, rows, write_jsonl, write_saved_dataset


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from hflow.tasks.tiny_models import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def numbered(count, start=0, source="s"):
    """Rows whose ``extra_info.index`` names them."""
    out = rows(count, source)
    for i, row in enumerate(out):
        row["extra_info"]["index"] = start + i
    return out


def write_groups(path, records, group_rows):
    """Parquet with row groups of `group_rows` rows: the pieces a stream reads one at a time."""
    pq.write_table(pa.Table.from_pandas(pd.DataFrame(records), preserve_index=False), path, row_group_size=group_rows)
    return str(path)


def three_files(tmp_path):
    return [write_groups(tmp_path / "a.parquet", numbered(10, 0), group_rows=3),
            write_jsonl(tmp_path / "b.jsonl", numbered(7, 100)),
            write_saved_dataset(tmp_path / "c", numbered(8, 200), shards=2)]


def loader(tokenizer, files, batch_size=4, **settings):
    config = data_config(streaming=True, shuffle_buffer=5, train_batch_size=batch_size, **settings)
    return StreamingDataLoader(StreamedPrompts(files, tokenizer, config), batch_size)


def ids(batch):
    return [int(i) for i in batch["index"]]


def run(stream, epochs):
    return [ids(batch) for epoch in range(stream.epoch, epochs) for batch in stream]


def test_each_epoch_draws_every_row_once_in_a_seeded_shuffled_order(tokenizer, tmp_path):
    files = three_files(tmp_path)
    stream = loader(tokenizer, files, batch_size=5)
    assert len(stream) == 5  # 25 rows
    epochs = [sum((ids(b) for b in stream), []) for _ in range(2)]
    everything = sorted([*range(10), *range(100, 107), *range(200, 208)])
    assert sorted(epochs[0]) == sorted(epochs[1]) == everything
    assert epochs[0] != everything and epochs[0] != epochs[1]  # shuffled, and anew each epoch
    assert run(loader(tokenizer, files, batch_size=5), 2) == [epochs[e][i:i + 5] for e in range(2)
                                                              for i in range(0, 25, 5)]  # same seed, same order
    in_order = loader(tokenizer, files, batch_size=5, shuffle=False)
    assert sum(run(in_order, 1), []) == [*range(10), *range(100, 107), *range(200, 208)]


@pytest.mark.parametrize("stop_after", [1, 3, 5, 7])  # within the first epoch, at its end, within the second
def test_a_resumed_stream_continues_at_the_exact_row(tokenizer, tmp_path, stop_after):
    files = three_files(tmp_path)
    uninterrupted = run(loader(tokenizer, files), 3)
    assert len(uninterrupted) == 18  # 6 batches of 4 per epoch, the 25th row dropped
    first = loader(tokenizer, files)
    taken = []
    while len(taken) < stop_after:
        for batch in first:
            taken.append(ids(batch))
            if len(taken) == stop_after:
                break
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    assert taken == uninterrupted[:stop_after]
    resumed = loader(tokenizer, files)  # a new process: the files read again from the start
    resumed.load_state_dict(state)
    assert run(resumed, 3) == uninterrupted[stop_after:]


def test_a_streamed_mixture_draws_by_weight_and_resumes_exactly(tokenizer, tmp_path):
    files = [write_groups(tmp_path / "small.parquet", numbered(6, 0, "small"), group_rows=4),
             write_jsonl(tmp_path / "large.jsonl", numbered(40, 100, "large"))]
    settings = {"train_files": files, "mixture": [3, 1]}
    stream = loader(tokenizer, files, **settings)
    assert len(stream) == 11  # an epoch: as many draws as rows (46), in batches of 4
    drawn = [int(f) for epoch in range(stream.epoch, 12) for batch in stream for f in batch["data_file"]]
    share = drawn.count(0) / len(drawn)
    assert abs(share - 0.75) < 0.04, share  # the small file, weighted 3:1, is repeated to its share
    uninterrupted = run(loader(tokenizer, files, **settings), 2)
    first = loader(tokenizer, files, **settings)
    taken = [ids(b) for b in first] + [ids(next(iter(first)))]  # into the second epoch
    assert taken == uninterrupted[:12]
    resumed = loader(tokenizer, files, **settings)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert run(resumed, 2) == uninterrupted[12:]
    with pytest.raises(ConfigError, match=r"mixture \[3.0, 1.0\] → \[1.0, 1.0\]"):
        loader(tokenizer, files, train_files=files, mixture=[1, 1]).load_state_dict(first.state_dict())


def test_rows_are_read_lazily(tokenizer, tmp_path, monkeypatch):
    import hflow.utils.dataset.streaming as streaming

    path = write_groups(tmp_path / "big.parquet", numbered(60), group_rows=4)
    stream = loader(tokenizer, [path])
    pieces = []

    def recorded(*args, **kwargs):  # the real reader, its pieces' sizes noted as they are read
        for piece in streaming.iter_tables(*args, **kwargs):
            pieces.append(piece.num_rows)
            yield piece

    monkeypatch.setattr(stream.dataset, "_pieces", lambda p: recorded(p, "data.train_files"))
    next(iter(stream))
    assert 5 + 4 <= stream.state_dict()["rows_read"][0] <= 5 + 4 + 4  # the buffer, the batch, a row group's rest
    assert set(pieces) == {4} and sum(pieces) <= 5 + 4 + 4  # row group by row group, never the whole file


def test_resuming_on_changed_data_is_refused(tokenizer, tmp_path):
    files = three_files(tmp_path)
    first = loader(tokenizer, files)
    next(iter(first))
    state = first.state_dict()
    state["rows_read"] = [r + 1 for r in state["rows_read"]]  # the files led elsewhere when it was saved
    resumed = loader(tokenizer, files)
    resumed.load_state_dict(state)
    with pytest.raises(ConfigError, match=r"data.streaming: the saved position .* is not where the files lead now"):
        next(iter(resumed))
    with pytest.raises(ConfigError, match=r"shuffle_buffer 5 → 2"):
        StreamingDataLoader(StreamedPrompts(files, tokenizer, data_config(streaming=True, shuffle_buffer=2,
                                                                          train_batch_size=4)), 4).load_state_dict(
            first.state_dict())


def test_overlong_prompts_are_filtered_as_in_memory(tokenizer, tmp_path):
    records = numbered(12)
    for i in (2, 7, 8):
        records[i]["prompt"][1]["content"] = "a very long question " * 20
    path = write_groups(tmp_path / "long.parquet", records, group_rows=5)
    settings = {"filter_overlong_prompts": True, "max_prompt_length": 40}
    stream = loader(tokenizer, [path], batch_size=3, **settings)
    in_memory = RLHFDataset(path, tokenizer, data_config(**settings))
    assert stream.dataset.num_filtered == in_memory.num_filtered == 3
    streamed = sorted(sum(run(stream, 1), []))
    assert streamed == sorted(in_memory[i]["index"] for i in range(len(in_memory))) == [0, 1, 3, 4, 5, 6, 9, 10, 11]
    with pytest.raises(DataError, match=rf"data.train_files: {path} row 2: the prompt of sample 2 is \d+ tokens, "
                                        r"longer than data.max_prompt_length=40"):
        loader(tokenizer, [path], batch_size=3, max_prompt_length=40)  # no filter, truncation=error: refused at once


@pytest.mark.parametrize("form", ["parquet", "jsonl", "save_to_disk"])
def test_a_bad_row_in_a_later_piece_is_named_with_its_file_and_row(tokenizer, tmp_path, form, monkeypatch):
    monkeypatch.setattr("hflow.utils.dataset.sources.JSONL_BLOCK_ROWS", 4)  # JSON lines in pieces of 4 too
    records = numbered(11)
    records[9]["prompt"] = [{"role": "user", "content": None}]
    path = {"parquet": lambda: write_groups(tmp_path / "bad.parquet", records, group_rows=4),
            "jsonl": lambda: write_jsonl(tmp_path / "bad.jsonl", records),
            "save_to_disk": lambda: write_saved_dataset(tmp_path / "bad", records, shards=3)}[form]()
    where = r"row 9 \(line 10\)" if form == "jsonl" else "row 9"
    with pytest.raises(DataError, match=rf"data.train_files: {path} {where}: a message of column 'prompt' has no "
                                        r"'content'"):
        loader(tokenizer, [path])


def test_streaming_settings_are_checked_naming_the_key(tmp_path):
    files = [write_jsonl(tmp_path / "a.jsonl", rows(2)), write_jsonl(tmp_path / "b.jsonl", rows(2))]
    with pytest.raises(ConfigError, match=r"data.mixture has 1 weights but data.train_files has 2 files"):
        check_data(data_config(train_files=files, val_files=files[0], streaming=True, mixture=[1]))
    with pytest.raises(ConfigError, match=r"data.shuffle_buffer=0; it must be at least 1"):
        check_data(data_config(train_files=files, val_files=files[0], streaming=True, shuffle_buffer=0))
    with pytest.raises(ConfigError, match=r"set data.dataloader_num_workers=0"):
        check_data(data_config(train_files=files, val_files=files[0], streaming=True, dataloader_num_workers=2))


def test_reward_normalization_with_streaming_is_refused_in_preflight():
    from hflow.trainer.config import default_config
    from hflow.trainer.preflight import check_reward_shaping

    config = default_config()
    config.data.streaming = True
    config.reward_model.normalize.enable = True
    with pytest.raises(ConfigError, match=r"reward_model.normalize.enable=true .* data.streaming=true does not hold"):
        check_reward_shaping(config)
