"""Token-budget micro-batching: budgets hold, loads balance, and the reverse index restores the batch."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from hflow.protocol import DataProto
from hflow.workers.seqlen_balancing import (
    balanced_partitions,
    get_reverse_idx,
    rearrange_micro_batches,
    split_micro_batches,
    split_mini_batches,
)


def make_batch(lengths: list[int], width: int = 16) -> TensorDict:
    """Rows whose attention masks hold `lengths` tokens (left-padded); `row_id` names each row."""
    n = len(lengths)
    mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()
    return TensorDict(
        {
            "attention_mask": mask,
            "input_ids": torch.randint(0, 100, (n, width), generator=torch.Generator().manual_seed(0)) * mask,
            "row_id": torch.arange(n),
        },
        batch_size=[n],
    )


def test_balanced_partitions_are_exhaustive_non_empty_and_balanced():
    lengths = [9, 1, 7, 3, 3, 8, 2, 5, 6, 4]
    groups = balanced_partitions(lengths, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g for g in groups)
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert max(sums) - min(sums) <= 1  # 48 tokens in 3 groups: 16 each is possible, LPT gets within 1
    with pytest.raises(ValueError, match="non-empty"):
        balanced_partitions([1, 2], 3)


def test_balanced_partitions_never_leave_a_group_empty_with_zero_lengths():
    assert all(balanced_partitions([0, 0, 0, 5], 4))


@pytest.mark.parametrize("budget", [16, 20, 33, 1000])
def test_rearrange_respects_budget_and_reverse_index_restores_batch(budget: int):
    lengths = torch.randint(1, 17, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    batch = make_batch(lengths)
    micro_batches, groups = rearrange_micro_batches(batch, max_token_len=budget)

    assert all(int(mb["attention_mask"].sum()) <= budget for mb in micro_batches)
    assert len(micro_batches) >= -(-sum(lengths) // budget)
    order = [i for g in groups for i in g]
    assert sorted(order) == list(range(len(lengths)))
    for mb, g in zip(micro_batches, groups, strict=True):
        assert mb["row_id"].tolist() == g

    restored = torch.cat(list(micro_batches))[get_reverse_idx(order)]
    assert (restored == batch).all()


def test_rearrange_uses_few_micro_batches_when_balanced_packing_allows():
    batch = make_batch([8, 8, 8, 8, 4, 4, 4, 4])
    micro_batches, _ = rearrange_micro_batches(batch, max_token_len=24)
    assert len(micro_batches) == 2
    assert [int(mb["attention_mask"].sum()) for mb in micro_batches] == [24, 24]


def test_rearrange_accepts_a_dataproto():
    data = DataProto(batch=make_batch([3, 9, 4, 12, 7]), meta_info={"temperature": 0.5})
    micro_batches, groups = rearrange_micro_batches(data, max_token_len=13)
    assert all(isinstance(mb, DataProto) and mb.meta_info["temperature"] == 0.5 for mb in micro_batches)
    restored = DataProto.concat(micro_batches)
    restored.reorder(get_reverse_idx([i for g in groups for i in g]))
    assert restored.batch["row_id"].tolist() == list(range(5))


def test_rearrange_rejects_a_sequence_over_budget():
    with pytest.raises(ValueError, match="max_token_len=10"):
        rearrange_micro_batches(make_batch([4, 11]), max_token_len=10)


def test_get_reverse_idx_inverts_a_permutation():
    order = [3, 0, 4, 1, 2]
    assert get_reverse_idx(order).tolist() == [1, 3, 4, 0, 2]
    values = torch.tensor(order) * 10  # emitted in `order`
    assert values[get_reverse_idx(order)].tolist() == [0, 10, 20, 30, 40]


def test_split_micro_batches_fixed_and_dynamic():
    batch = make_batch([5, 5, 5, 5, 5])
    fixed, reverse = split_micro_batches(batch, micro_batch_size=2)
    assert [len(mb) for mb in fixed] == [2, 2, 1] and reverse is None
    dynamic, reverse = split_micro_batches(batch, max_token_len=10, use_dynamic_bsz=True)
    assert torch.cat(dynamic)[reverse]["row_id"].tolist() == list(range(5))
    with pytest.raises(ValueError, match="micro_batch_size"):
        split_micro_batches(batch)
    with pytest.raises(ValueError, match="max_token_len"):
        split_micro_batches(batch, use_dynamic_bsz=True)


def test_split_mini_batches_in_order_or_reproducibly_shuffled():
    batch = make_batch([1] * 8)
    assert [mb["row_id"].tolist() for mb in split_mini_batches(batch, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    def shuffled(seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return [mb["row_id"].tolist() for mb in split_mini_batches(batch, 4, shuffle=True, generator=gen)]

    assert shuffled(0) == shuffled(0)
    assert sorted(sum(shuffled(0), [])) == list(range(8))
    assert shuffled(0) != [[0, 1, 2, 3], [4, 5, 6, 7]]
