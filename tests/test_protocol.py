"""Tests for hflow.protocol (DataProto and helpers). CPU only, no Ray."""

from __future__ import annotations

import pickle
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from hflow.protocol import (
    DataProto,
    DataProtoConfig,
    DataProtoError,
    DataProtoFuture,
    DataProtoItem,
    all_gather_data_proto,
    collate_fn,
    fold_batch_dim,
    list_of_dict_to_dict_of_list,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)


def make_data(meta_info: dict | None = None) -> DataProto:
    """6 rows: obs = [1..6], labels = a..f."""
    return DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2, 3, 4, 5, 6])},
        non_tensors={"labels": ["a", "b", "c", "d", "e", "f"]},
        meta_info={"name": "abc"} if meta_info is None else meta_info,
    )


def make_pairs() -> DataProto:
    """3 rows: obs = [[1,2],[3,4],[5,6]], labels = a..c."""
    return DataProto.from_dict(
        tensors={"obs": torch.tensor([[1, 2], [3, 4], [5, 6]])},
        non_tensors={"labels": ["a", "b", "c"]},
        meta_info={"info": "test_info"},
    )


def assert_same(a: DataProto, b: DataProto) -> None:
    """Same keys (in order), dtypes, values and meta_info."""
    if b.batch is None:
        assert a.batch is None
    else:
        assert list(a.batch.keys()) == list(b.batch.keys())
        assert a.batch.batch_size == b.batch.batch_size
        for key in b.batch.keys():
            assert a.batch[key].dtype == b.batch[key].dtype
            assert torch.equal(a.batch[key], b.batch[key]), key
    assert list(a.non_tensor_batch) == list(b.non_tensor_batch)
    for key, value in b.non_tensor_batch.items():
        assert a.non_tensor_batch[key].shape == value.shape
        assert a.non_tensor_batch[key].tolist() == value.tolist(), key
    assert a.meta_info == b.meta_info


def labels(data: DataProto) -> list:
    return data.non_tensor_batch["labels"].tolist()


# ---- construction and consistency --------------------------------------------------------------


def test_from_dict_builds_one_batch_dim():
    data = DataProto.from_dict({"obs": torch.randn(100, 10), "act": torch.randn(100, 10, 3)})
    assert data.batch.batch_size == torch.Size([100])
    assert len(data) == 100
    for num_batch_dims in (2, 3):
        with pytest.raises(AssertionError, match="num_batch_dims"):
            DataProto.from_dict({"obs": torch.randn(100, 10, 3)}, num_batch_dims=num_batch_dims)


def test_data_proto_error_is_value_error_and_assertion_error():
    assert issubclass(DataProtoError, ValueError)
    assert issubclass(DataProtoError, AssertionError)


def test_from_dict_tensor_shape_mismatch_names_key():
    with pytest.raises(DataProtoError) as info:
        DataProto.from_dict({"a": torch.zeros(4, 3), "b": torch.zeros(5, 3)})
    assert str(info.value) == (
        "DataProto.from_dict: tensor 'b' has batch size 5 but 'a' has 4; all tensors must share dim 0"
    )


def test_from_dict_non_tensor_length_mismatch_names_key():
    with pytest.raises(DataProtoError, match=r"non-tensor 'labels' has 2 rows but the batch has 3"):
        DataProto.from_dict({"obs": torch.zeros(3)}, {"labels": ["a", "b"]})
    with pytest.raises(DataProtoError, match=r"non-tensor 'y' has 2 rows but 'x' has 3"):
        DataProto.from_dict(non_tensors={"x": [1, 2, 3], "y": [1, 2]})


def test_from_dict_rejects_wrong_types():
    with pytest.raises(DataProtoError, match="tensor 'obs' is a list"):
        DataProto.from_dict({"obs": [1, 2, 3]})
    with pytest.raises(DataProtoError, match="non-tensor 'name' is a str"):
        DataProto.from_dict(non_tensors={"name": "abc"})


def test_constructor_checks_consistency():
    with pytest.raises(DataProtoError, match="non-tensor 'x' is a list"):
        DataProto(non_tensor_batch={"x": [1, 2]})
    with pytest.raises(DataProtoError, match="exactly one batch dimension"):
        DataProto(batch=TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(DataProtoError, match="non-tensor 'x' has 3 rows but the batch has 2"):
        DataProto(batch=TensorDict({"a": torch.zeros(2)}, batch_size=[2]), non_tensor_batch={"x": np.zeros(3)})


def test_empty_and_non_tensor_only_batches():
    empty = DataProto.from_dict({})
    assert empty.batch is None and len(empty) == 0

    only_objects = DataProto.from_dict(non_tensors={"labels": ["a", "b"]}, meta_info={"k": 1})
    assert only_objects.batch is None
    assert len(only_objects) == 2
    assert labels(only_objects[1:]) == ["b"]

    zero_rows = DataProto.from_dict({"obs": torch.zeros(0, 4)}, {"labels": []})
    assert len(zero_rows) == 0
    assert zero_rows.non_tensor_batch["labels"].shape == (0,)


def test_len():
    assert len(make_data()) == 6
    assert len(DataProto(non_tensor_batch={"x": np.array([1, 2, 3], dtype=object)})) == 3
    assert len(DataProto(meta_info={"a": 1})) == 0
    assert len(DataProto(batch=None, non_tensor_batch=None, meta_info={"a": 1})) == 0


def test_non_tensors_become_1d_object_arrays():
    data = DataProto.from_dict(
        non_tensors={
            "lists": [[1, 2], [3, 4]],  # equal lengths: must not become a 2-D array
            "dicts": [{"ground_truth": "7"}, {"ground_truth": "8"}],
            "strings": np.array(["x", "y"]),
        }
    )
    for value in data.non_tensor_batch.values():
        assert value.dtype == object and value.shape == (2,)
    assert data.non_tensor_batch["lists"][1] == [3, 4]
    assert data.non_tensor_batch["dicts"][0] == {"ground_truth": "7"}
    assert data.non_tensor_batch["strings"].tolist() == ["x", "y"]


def test_from_single_dict_sorts_values_and_keeps_subclass():
    class CustomProto(DataProto):
        pass

    data = CustomProto.from_single_dict({"obs": torch.arange(3), "labels": np.array(["a", "b", "c"])}, {"k": 1})
    assert type(data) is CustomProto
    assert torch.equal(data.batch["obs"], torch.arange(3))
    assert labels(data) == ["a", "b", "c"]
    assert data.meta_info == {"k": 1}
    with pytest.raises(DataProtoError, match="'labels' is a list"):
        DataProto.from_single_dict({"labels": ["a"]})


# ---- indexing ----------------------------------------------------------------------------------


def test_int_index_returns_item():
    item = make_data()[np.int64(2)]
    assert isinstance(item, DataProtoItem)
    assert item.batch["obs"].item() == 3
    assert item.non_tensor_batch == {"labels": "c"}
    assert item.meta_info == {"name": "abc"}
    assert make_data()[-1].non_tensor_batch["labels"] == "f"


def test_slice_index():
    part = make_data()[1:5:2]
    assert part.batch["obs"].tolist() == [2, 4]
    assert labels(part) == ["b", "d"]
    assert part.meta_info == {"name": "abc"}
    assert make_data().slice(4).batch["obs"].tolist() == [5, 6]


@pytest.mark.parametrize(
    "index",
    [
        [4, 0, 0],
        np.array([4, 0, 0]),
        torch.tensor([4, 0, 0]),
        torch.tensor([4, 0, 0], dtype=torch.int32),
    ],
    ids=["list", "numpy", "torch", "torch-int32"],
)
def test_integer_array_index(index):
    picked = make_data()[index]
    assert picked.batch["obs"].tolist() == [5, 1, 1]
    assert labels(picked) == ["e", "a", "a"]
    assert picked.meta_info == {"name": "abc"}


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
def test_bool_mask_index(kind):
    mask = [True, False, True, False, False, True]
    index = {"list": mask, "numpy": np.array(mask), "torch": torch.tensor(mask)}[kind]
    picked = make_data()[index]
    assert picked.batch["obs"].tolist() == [1, 3, 6]
    assert labels(picked) == ["a", "c", "f"]


def test_bad_indices_raise():
    with pytest.raises(TypeError):
        make_data()["obs"]
    with pytest.raises(TypeError, match="integers or booleans"):
        make_data()[np.array([0.0, 1.0])]
    with pytest.raises(IndexError, match="3 entries but the batch has 6 rows"):
        make_data()[[True, False, True]]


def test_select_idxs_empty_and_non_tensor_only():
    assert len(make_data().select_idxs([])) == 0
    only_objects = DataProto.from_dict(non_tensors={"labels": ["a", "b", "c"]})
    assert labels(only_objects.select_idxs(np.array([2, 0]))) == ["c", "a"]


# ---- keys --------------------------------------------------------------------------------------


def test_select_keys_and_deepcopy():
    data = DataProto.from_dict(
        {"obs": torch.arange(2), "act": torch.arange(2)},
        {"labels": [{"x": 1}, {"x": 2}], "other": ["p", "q"]},
        {"a": 1, "b": [1]},
    )
    sub = data.select(batch_keys=["act"], non_tensor_batch_keys=["labels"], meta_info_keys=["b"])
    assert list(sub.batch.keys()) == ["act"]
    assert list(sub.non_tensor_batch) == ["labels"]
    assert sub.meta_info == {"b": [1]}
    assert sub.batch["act"].data_ptr() == data.batch["act"].data_ptr()  # tensors shared

    copied = data.select(deepcopy=True)
    copied.non_tensor_batch["labels"][0]["x"] = 100
    copied.meta_info["b"].append(2)
    assert data.non_tensor_batch["labels"][0] == {"x": 1}
    assert data.meta_info["b"] == [1]

    with pytest.raises(KeyError, match="tensor key 'missing' not found"):
        data.select(batch_keys=["missing"])


def test_pop():
    data = DataProto.from_dict(
        {"obs": torch.randn(10, 4), "act": torch.randn(10, 3)}, {"labels": list("abcdefghij")}, {"2": 2, "1": 1}
    )
    obs = data.batch["obs"]
    popped = data.pop(batch_keys=["obs"], non_tensor_batch_keys=["labels"], meta_info_keys=["2"])
    assert list(popped.batch.keys()) == ["obs"]
    assert torch.equal(popped.batch["obs"], obs)
    assert labels(popped) == list("abcdefghij")
    assert popped.meta_info == {"2": 2}
    assert list(data.batch.keys()) == ["act"]
    assert data.non_tensor_batch == {}
    assert data.meta_info == {"1": 1}


def test_pop_missing_key_names_it_and_changes_nothing():
    data = make_data()
    with pytest.raises(KeyError, match="non-tensor key 'nope' not found"):
        data.pop(batch_keys=["obs"], non_tensor_batch_keys=["nope"])
    assert list(data.batch.keys()) == ["obs"]


def test_rename():
    data = DataProto.from_dict({"a": torch.arange(2), "b": torch.arange(2) + 5})
    assert data.rename("a", "x") is data
    data.rename(["b"], ["y"])
    assert sorted(data.batch.keys()) == ["x", "y"]
    assert data.batch["y"].tolist() == [5, 6]
    with pytest.raises(ValueError, match="2 old keys but 1 new keys"):
        data.rename(["x", "y"], ["z"])
    with pytest.raises(KeyError, match="'a' not found"):
        data.rename("a", "z")


# ---- union -------------------------------------------------------------------------------------


def test_union_tensor_dict():
    obs = torch.randn(10, 3)
    td1 = TensorDict({"obs": obs, "act": torch.randn(10, 2)}, batch_size=[10])
    td2 = TensorDict({"obs": obs.clone(), "rew": torch.randn(10)}, batch_size=[10])
    merged = union_tensor_dict(td1, td2)
    assert merged is td1
    assert sorted(td1.keys()) == ["act", "obs", "rew"]

    td3 = TensorDict({"obs": obs, "rew": torch.randn(10)}, batch_size=[10])
    with pytest.raises(AssertionError, match="tensor 'rew' differs"):
        union_tensor_dict(td1, td3)
    with pytest.raises(DataProtoError, match=r"batch sizes differ: \[10\] vs \[5\]"):
        union_tensor_dict(td1, TensorDict({"x": torch.zeros(5)}, batch_size=[5]))


def test_union_numpy_dict_treats_nan_and_objects_as_equal_to_themselves():
    mixed = np.array(["abc", np.nan, "nan"], dtype=object)
    d1 = {"nan": np.full(3, np.nan), "mixed": mixed, "tiled": np.tile(mixed, (2, 1)).T}
    d2 = {"nan": np.full(3, np.nan), "mixed": mixed.copy(), "tiled": np.tile(mixed, (2, 1)).T.copy(), "new": np.ones(3)}
    assert union_numpy_dict(d1, d2) is d1
    assert sorted(d1) == ["mixed", "nan", "new", "tiled"]

    swapped = np.array(["abc", "nan", np.nan], dtype=object)  # "nan" string is not NaN
    with pytest.raises(AssertionError, match="non-tensor 'mixed' differs"):
        union_numpy_dict(d1, {"mixed": swapped})


def test_union_data_proto():
    left = DataProto.from_dict({"obs": torch.arange(3)}, {"labels": ["a", "b", "c"]}, {"eos": 2})
    right = DataProto.from_dict({"obs": torch.arange(3), "rew": torch.ones(3)}, {"uid": ["u", "v", "w"]}, {"t": 1.0})
    assert left.union(right) is left
    assert sorted(left.batch.keys()) == ["obs", "rew"]
    assert sorted(left.non_tensor_batch) == ["labels", "uid"]
    assert left.meta_info == {"eos": 2, "t": 1.0}

    # A non-tensor-only side is fine.
    extra = DataProto.from_dict(non_tensors={"score": [1, 2, 3]})
    assert left.union(extra).non_tensor_batch["score"].tolist() == [1, 2, 3]
    only_objects = DataProto.from_dict(non_tensors={"x": [1, 2, 3]})
    only_objects.union(left)
    assert torch.equal(only_objects.batch["rew"], torch.ones(3))


@pytest.mark.parametrize(
    "other, message",
    [
        (DataProto.from_dict({"obs": torch.arange(3) + 1, "new": torch.zeros(3)}), "tensor 'obs' differs"),
        (DataProto.from_dict({"new": torch.zeros(3)}, {"labels": ["a", "b", "z"]}), "non-tensor 'labels' differs"),
        (DataProto.from_dict({"new": torch.zeros(3)}, meta_info={"eos": 3}), "meta_info 'eos' differs: 2 vs 3"),
        (DataProto.from_dict({"obs": torch.arange(4)}), "batch sizes differ: 3 vs 4"),
    ],
    ids=["tensor", "non-tensor", "meta", "length"],
)
def test_union_conflicts_name_the_key_and_leave_self_unchanged(other, message):
    data = DataProto.from_dict({"obs": torch.arange(3)}, {"labels": ["a", "b", "c"]}, {"eos": 2})
    other.meta_info["new_meta"] = 1
    with pytest.raises(DataProtoError, match=message):
        data.union(other)
    assert list(data.batch.keys()) == ["obs"]
    assert torch.equal(data.batch["obs"], torch.arange(3))
    assert list(data.non_tensor_batch) == ["labels"]
    assert data.meta_info == {"eos": 2}


# ---- chunk / split / concat --------------------------------------------------------------------


def test_chunk_and_concat_restore_original():
    data = make_data()
    with pytest.raises(AssertionError, match="6 rows cannot be split into 5 equal chunks"):
        data.chunk(5)
    first, second = data.chunk(2)
    assert first.batch["obs"].tolist() == [1, 2, 3] and labels(first) == ["a", "b", "c"]
    assert second.batch["obs"].tolist() == [4, 5, 6] and labels(second) == ["d", "e", "f"]
    assert first.meta_info == second.meta_info == {"name": "abc"}
    assert_same(DataProto.concat([first, second]), data)


def test_chunk_with_padding_enabled_follows_torch_chunk():
    data = DataProto.from_dict({"obs": torch.arange(7)}, {"labels": list("abcdefg")}, auto_padding=True)
    assert data.is_padding_enabled()
    pieces = data.chunk(3)
    assert [p.batch["obs"].tolist() for p in pieces] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [labels(p) for p in pieces] == [["a", "b", "c"], ["d", "e", "f"], ["g"]]
    assert_same(DataProto.concat(pieces), data)


def test_global_auto_padding_switch(monkeypatch):
    data = make_data()
    assert not data.is_padding_enabled()
    monkeypatch.setattr(DataProtoConfig, "_auto_padding", True)
    assert data.is_padding_enabled()
    monkeypatch.setattr(DataProtoConfig, "_auto_padding", False)
    monkeypatch.setenv("HFLOW_AUTO_PADDING", "TRUE")
    assert data.is_padding_enabled()
    with pytest.raises(TypeError):
        DataProtoConfig.auto_padding = "yes"


@pytest.mark.parametrize("size", [4, 5, 7, 19])
def test_padding_then_chunk_gives_equal_pieces(size):
    data = DataProto.from_dict({"a": torch.arange(size)}, {"na": list(range(size))}, auto_padding=True)
    data.padding((4 - size % 4) % 4)
    assert [len(p) for p in data.chunk(4)] == [-(-size // 4)] * 4


def test_chunk_empty_and_non_tensor_only():
    empty = DataProto.from_dict({"obs": torch.zeros(0, 2)})
    assert [len(p) for p in empty.chunk(3)] == [0, 0, 0]
    only_objects = DataProto.from_dict(non_tensors={"labels": list("abcd")})
    assert [labels(p) for p in only_objects.chunk(2)] == [["a", "b"], ["c", "d"]]


def test_split_last_piece_smaller():
    pieces = make_data().split(4)
    assert [p.batch["obs"].tolist() for p in pieces] == [[1, 2, 3, 4], [5, 6]]
    assert [labels(p) for p in pieces] == [list("abcd"), list("ef")]
    assert all(p.meta_info == {"name": "abc"} for p in pieces)


def test_concat_merges_per_rank_metrics():
    def rank(obs, metrics):
        return DataProto.from_dict({"obs": torch.tensor(obs)}, meta_info={"metrics": metrics, "flag": True})

    merged = DataProto.concat(
        [
            rank([1, 2], [{"loss": 0.5, "acc": 0.9}]),  # list of dicts
            rank([3, 4], {"loss": 0.6, "acc": 0.8}),  # dict of scalars
            rank([5, 6], {"loss": [0.7, 0.75]}),  # dict of lists (per micro-batch)
        ]
    )
    assert merged.batch["obs"].tolist() == [1, 2, 3, 4, 5, 6]
    assert merged.meta_info == {"flag": True, "metrics": {"loss": [0.5, 0.6, 0.7, 0.75], "acc": [0.9, 0.8]}}


def test_concat_metrics_edge_cases():
    no_metrics = DataProto.from_dict({"obs": torch.tensor([1])}, meta_info={"flag": True})
    with_metrics = DataProto.from_dict({"obs": torch.tensor([2])}, meta_info={"metrics": {"loss": 0.6}})
    empty_metrics = DataProto.from_dict({"obs": torch.tensor([3])}, meta_info={"metrics": []})
    merged = DataProto.concat([no_metrics, with_metrics, empty_metrics])
    assert merged.meta_info == {"flag": True, "metrics": {"loss": [0.6]}}
    assert "metrics" not in DataProto.concat([no_metrics, no_metrics]).meta_info


def test_concat_merges_other_meta_and_rejects_conflicts():
    a = DataProto.from_dict({"obs": torch.tensor([1])}, meta_info={"config": "A", "shared": "X"})
    b = DataProto.from_dict({"obs": torch.tensor([2])}, meta_info={"extra": "B", "shared": "X"})
    assert DataProto.concat([a, b]).meta_info == {"config": "A", "shared": "X", "extra": "B"}

    c = DataProto.from_dict({"obs": torch.tensor([3])}, meta_info={"config": "C"})
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'config': 'A' in part 0 vs 'C'"):
        DataProto.concat([a, c])


def test_concat_empty_parts_and_key_mismatch():
    data = make_data()
    zero_rows = data[0:0]
    meta_only = DataProto(meta_info={"metrics": {"loss": 1.0}})
    merged = DataProto.concat([zero_rows, data, meta_only])
    assert merged.batch["obs"].tolist() == [1, 2, 3, 4, 5, 6]
    assert labels(merged) == list("abcdef")
    assert merged.meta_info == {"name": "abc", "metrics": {"loss": [1.0]}}

    other = DataProto.from_dict({"act": torch.tensor([1])}, {"labels": ["z"]})
    with pytest.raises(DataProtoError, match=r"part 1 has tensor keys \['act'\] but part 0 has \['obs'\]"):
        DataProto.concat([data, other])
    with pytest.raises(DataProtoError, match="empty list"):
        DataProto.concat([])


def test_concat_non_tensor_only():
    parts = [DataProto.from_dict(non_tensors={"x": [{"a": 1}]}), DataProto.from_dict(non_tensors={"x": [{"a": 2}]})]
    merged = DataProto.concat(parts)
    assert merged.batch is None
    assert merged.non_tensor_batch["x"].tolist() == [{"a": 1}, {"a": 2}]


# ---- row order and repetition ------------------------------------------------------------------


def test_reorder():
    data = make_data()
    data.reorder(torch.tensor([3, 4, 2, 0, 1, 5]))
    assert data.batch["obs"].tolist() == [4, 5, 3, 1, 2, 6]
    assert labels(data) == list("decabf")
    assert data.meta_info == {"name": "abc"}


def test_repeat_interleaved_and_tiled():
    data = make_pairs()
    interleaved = data.repeat(repeat_times=2, interleave=True)
    assert interleaved.batch["obs"].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]]
    assert labels(interleaved) == ["a", "a", "b", "b", "c", "c"]
    assert interleaved.meta_info == {"info": "test_info"}

    tiled = data.repeat(repeat_times=2, interleave=False)
    assert tiled.batch["obs"].tolist() == [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [5, 6]]
    assert labels(tiled) == ["a", "b", "c", "a", "b", "c"]

    only_objects = DataProto.from_dict(non_tensors={"lists": [[1], [2]]})
    assert only_objects.repeat(2, interleave=False).non_tensor_batch["lists"].tolist() == [[1], [2], [1], [2]]


@pytest.mark.parametrize("counts", [[2, 0, 1], (2, 0, 1), np.array([2, 0, 1]), torch.tensor([2, 0, 1])])
def test_sample_level_repeat(counts):
    repeated = make_pairs().sample_level_repeat(counts)
    assert repeated.batch["obs"].tolist() == [[1, 2], [1, 2], [5, 6]]
    assert labels(repeated) == ["a", "a", "c"]


def test_sample_level_repeat_needs_one_count_per_row():
    with pytest.raises(DataProtoError, match="one count per row"):
        make_pairs().sample_level_repeat([1, 2])


def test_padding_repeats_last_or_first_row_in_place():
    data = make_pairs()
    data.padding(2)
    assert data.batch["obs"].tolist() == [[1, 2], [3, 4], [5, 6], [5, 6], [5, 6]]
    assert labels(data) == ["a", "b", "c", "c", "c"]

    data = make_pairs()
    data.padding(1, padding_candidate="first")
    assert labels(data) == ["a", "b", "c", "a"]

    data.padding(0)
    assert len(data) == 4
    with pytest.raises(DataProtoError, match="no row to repeat"):
        DataProto.from_dict({"obs": torch.zeros(0)}).padding(1)


def test_pad_dataproto_to_divisor_and_unpad():
    data = make_pairs()
    for divisor, pad, rows in [(2, 1, [0]), (3, 0, []), (7, 4, [0, 1, 2, 0])]:
        padded, pad_size = pad_dataproto_to_divisor(data, divisor)
        assert pad_size == pad
        expected = [[1, 2], [3, 4], [5, 6]] + [[[1, 2], [3, 4], [5, 6]][r] for r in rows]
        assert padded.batch["obs"].tolist() == expected
        assert labels(padded) == ["a", "b", "c"] + [["a", "b", "c"][r] for r in rows]
        assert padded.meta_info == {"info": "test_info"}
        assert_same(unpad_dataproto(padded, pad_size), data)


def test_fold_and_unfold_batch_dim():
    data = make_pairs().repeat(2, interleave=True)
    folded = fold_batch_dim(data, new_batch_size=3)
    assert folded.batch["obs"].tolist() == [[[1, 2], [1, 2]], [[3, 4], [3, 4]], [[5, 6], [5, 6]]]
    assert folded.non_tensor_batch["labels"].tolist() == [["a", "a"], ["b", "b"], ["c", "c"]]

    folded.reorder(torch.tensor([1, 2, 0]))
    unfolded = unfold_batch_dim(folded, batch_dims=2)
    assert unfolded.batch["obs"].tolist() == [[3, 4], [3, 4], [5, 6], [5, 6], [1, 2], [1, 2]]
    assert labels(unfolded) == ["b", "b", "c", "c", "a", "a"]
    assert unfolded.meta_info == {"info": "test_info"}


# ---- iteration, collation, misc ----------------------------------------------------------------


def make_iterator_data() -> DataProto:
    return DataProto.from_dict({"obs": torch.arange(100)}, {"labels": [str(i) for i in range(100)]}, {"k": 1})


def epoch_orders(seed: int) -> list[list[int]]:
    batches = make_iterator_data().make_iterator(10, epochs=2, seed=seed, dataloader_kwargs={"shuffle": True})
    return [batch.batch["obs"].tolist() for batch in batches]


def test_make_iterator_is_deterministic_with_a_seed():
    first, again, other = epoch_orders(1), epoch_orders(1), epoch_orders(2)
    assert len(first) == 20 and all(len(b) == 10 for b in first)
    assert first == again
    assert first != other
    assert sorted(sum(first[:10], [])) == list(range(100))  # each epoch visits every row once
    assert first[:10] != first[10:]  # epochs are reshuffled


def test_make_iterator_rows_stay_aligned_and_carry_meta():
    data = make_iterator_data()
    batches = list(data.make_iterator(25, epochs=1))  # no shuffle: in order
    assert [b.batch["obs"][0].item() for b in batches] == [0, 25, 50, 75]
    for batch in data.make_iterator(20, epochs=1, seed=0, dataloader_kwargs={"shuffle": True}):
        assert [str(v) for v in batch.batch["obs"].tolist()] == labels(batch)
        assert batch.meta_info is data.meta_info
    with pytest.raises(DataProtoError, match="not divisible by mini_batch_size=30"):
        data.make_iterator(30, epochs=1)


def test_collate_fn_rebuilds_rows():
    data = DataProto.from_dict({"obs": torch.arange(3)}, {"dicts": [{"i": 0}, {"i": 1}, {"i": 2}]}, {"k": 1})
    collated = collate_fn([data[2], data[0]])
    assert collated.batch["obs"].tolist() == [2, 0]
    assert collated.non_tensor_batch["dicts"].tolist() == [{"i": 2}, {"i": 0}]
    assert collated.meta_info == {"k": 1}


def test_list_of_dict_to_dict_of_list():
    assert list_of_dict_to_dict_of_list([{"a": 1, "b": 2}, {"a": 3}]) == {"a": [1, 3], "b": [2]}


def test_to_device_and_print_size(capsys):
    data = make_data()
    assert data.to("cpu") is data
    assert data.batch.device == torch.device("cpu")
    DataProto.from_dict({"x": torch.zeros(2**20, dtype=torch.uint8)}).print_size(prefix="step ")
    assert capsys.readouterr().out == "step batch: 0.001 GiB, non_tensor_batch: 0.000 GiB\n"


def test_all_gather_data_proto_single_rank():
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        data = make_data()
        all_gather_data_proto(data, process_group=None)
        assert_same(data, make_data())
    finally:
        dist.destroy_process_group()


# ---- serialisation -----------------------------------------------------------------------------


def round_trip(data: DataProto) -> DataProto:
    """Pickle as Ray does: protocol 5, buffers out-of-band and handed back read-only."""
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(payload, buffers=[b.raw().toreadonly() for b in buffers])


def test_pickle_round_trip_keeps_dtypes_shapes_and_key_order():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    data = DataProto.from_dict(
        {
            "z_bf16": base.to(torch.bfloat16),
            "a_non_contiguous": base[:, ::2],
            "mask": base > 5,
            "ids": torch.arange(4, dtype=torch.int64),
            "half": torch.ones(4, 3, dtype=torch.float16),
        },
        {"labels": ["a", "b", "c", "d"], "dicts": [{"k": i} for i in range(4)], "lists": [[i, i] for i in range(4)]},
        {"eos": 2, "metrics": {"loss": [1.0]}},
    )
    assert not data.batch["a_non_contiguous"].is_contiguous()
    restored = round_trip(data)
    assert_same(restored, data)
    assert restored.non_tensor_batch["lists"].shape == (4,)


@pytest.mark.parametrize(
    "data",
    [
        DataProto.from_dict({"obs": torch.zeros(0, 3, dtype=torch.bfloat16)}, {"labels": []}),
        # A rank whose rows were all dispatch padding returns zero rows of wider dtypes.
        DataProto.from_dict({"ids": torch.zeros(0, 5, dtype=torch.int64), "lp": torch.zeros(0, 5)}),
        DataProto.from_dict(non_tensors={"labels": ["a", "b"]}, meta_info={"k": 1}),
        DataProto(meta_info={"metrics": {"loss": 1.0}}),
        DataProto(batch=TensorDict({"nested": {"x": torch.arange(2)}, "y": torch.ones(2)}, batch_size=[2])),
    ],
    ids=["zero-rows", "zero-rows-int64", "no-batch", "meta-only", "nested"],
)
def test_pickle_round_trip_edge_cases(data):
    restored = round_trip(data)
    if data.batch is None:
        assert restored.batch is None
    else:
        assert restored.batch.batch_size == data.batch.batch_size
        assert (restored.batch == data.batch).all()
    assert restored.non_tensor_batch.keys() == data.non_tensor_batch.keys()
    assert restored.meta_info == data.meta_info


def test_pickled_state_holds_one_buffer_not_one_tensor_per_key():
    data = DataProto.from_dict(
        {f"t{i}": torch.randn(8, 16) for i in range(5)} | {"bf16": torch.randn(8, 4).to(torch.bfloat16)},
        {"labels": list("abcdefgh")},
    )
    state = data.__getstate__()
    packed = state["batch"]
    assert isinstance(packed["buffer"], np.ndarray) and packed["buffer"].dtype == np.uint8
    assert not any(isinstance(value, torch.Tensor) for value in packed.values())

    # Protocol 5 hands exactly one buffer (all tensors) out-of-band, as Ray's serialiser does.
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1
    assert buffers[0].raw().nbytes >= 5 * 8 * 16 * 4 + 8 * 4 * 2
    assert len(payload) < 2048  # tensors are not in-band

    # Ray hands back read-only shared memory: the tensors must still be writable (one copy).
    read_only = [pickle.PickleBuffer(bytes(buffers[0].raw()))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when wrapping a read-only numpy array
        restored = pickle.loads(payload, buffers=read_only)
    assert_same(restored, data)
    restored.batch["t0"].add_(1)
    assert torch.equal(restored.batch["t0"], data.batch["t0"] + 1)


def test_unpickled_tensors_are_views_of_one_buffer():
    data = DataProto.from_dict({"a": torch.randn(4, 3), "b": torch.arange(4)})
    restored = round_trip(data)
    storages = {restored.batch[key].untyped_storage().data_ptr() for key in ("a", "b")}
    assert len(storages) == 1


def test_equal_batches_pickle_to_equal_bytes():
    make = lambda: DataProto.from_dict({"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(3)})  # noqa: E731
    assert pickle.dumps(make(), protocol=5) == pickle.dumps(make(), protocol=5)


def test_save_and_load_from_disk(tmp_path):
    data = make_data({"info": "test_info"})
    path = tmp_path / "data.pkl"
    data.save_to_disk(path)
    assert_same(DataProto.load_from_disk(path), data)


# ---- DataProtoFuture ---------------------------------------------------------------------------


def test_data_proto_future_chunk_and_get_with_fake_ray(monkeypatch):
    """Stands in for ray.get with an identity, so the collect/dispatch wiring is tested without Ray."""
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=lambda refs: list(refs)))
    parts = make_data().chunk(2)
    future = DataProtoFuture.concat(parts)
    assert future.collect_fn == DataProto.concat
    assert_same(future.get(), make_data())

    pieces = future.chunk(3)
    assert [p.get().batch["obs"].tolist() for p in pieces] == [[1, 2], [3, 4], [5, 6]]
    assert labels(pieces[1].chunk(2)[1].get()) == ["d"]  # a chunk of a chunk

    bad = DataProtoFuture(collect_fn=DataProto.concat, futures=[1])
    with pytest.raises(TypeError, match="not a DataProto"):
        bad.get()
