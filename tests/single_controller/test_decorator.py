"""The dispatch registry and `@register`, without Ray."""

import pickle

import pytest
import torch

from hflow.protocol import DataProto
from hflow.single_controller.base.decorator import (
    MAGIC_ATTR,
    SHARD_KWARG,
    Dispatch,
    Execute,
    get_predefined_dispatch_fn,
    padding_rows_per_rank,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from hflow.single_controller.base.worker_group import rank_side_class


def _dispatch(wg, *args, **kwargs):
    return args, kwargs


def _collect(wg, outputs):
    return outputs


def test_register_custom_dispatch_mode_and_remove():
    mode = register_dispatch_mode("test_mode", _dispatch, _collect)
    try:
        assert mode is Dispatch.TEST_MODE and "TEST_MODE" in Dispatch
        assert get_predefined_dispatch_fn(Dispatch.TEST_MODE) == {"dispatch_fn": _dispatch, "collect_fn": _collect}
        with pytest.raises(ValueError, match="already exists"):
            register_dispatch_mode("TEST_MODE", _dispatch, _collect)
        # A registered mode can be used by @register.
        @register(dispatch_mode=Dispatch.TEST_MODE)
        def f(self):
            return 1

        assert getattr(f, MAGIC_ATTR)["dispatch_mode"] is Dispatch.TEST_MODE
    finally:
        Dispatch.remove("TEST_MODE")
    assert "TEST_MODE" not in Dispatch


def test_update_dispatch_mode_replaces_functions():
    original = dict(get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL))
    try:
        update_dispatch_mode(Dispatch.ONE_TO_ALL, _dispatch, _collect)
        assert get_predefined_dispatch_fn(Dispatch.ONE_TO_ALL)["dispatch_fn"] is _dispatch
    finally:
        update_dispatch_mode(Dispatch.ONE_TO_ALL, original["dispatch_fn"], original["collect_fn"])


def test_enum_members_pickle_to_the_same_singleton():
    assert pickle.loads(pickle.dumps(Dispatch.DP_COMPUTE_PROTO)) is Dispatch.DP_COMPUTE_PROTO
    assert pickle.loads(pickle.dumps(Execute.RANK_ZERO)) is Execute.RANK_ZERO
    assert Dispatch["one_to_all"] is Dispatch.ONE_TO_ALL
    assert Dispatch.ONE_TO_ALL.value != Dispatch.ALL_TO_ALL.value


def test_register_rejects_unknown_modes():
    with pytest.raises(ValueError, match="dispatch_mode must be one of"):
        register(dispatch_mode="DP")
    with pytest.raises(ValueError, match="execute_mode must be one of"):
        register(execute_mode="everyone")
    with pytest.raises(ValueError, match="collect_fn"):
        register(dispatch_mode={"dispatch_fn": _dispatch})


def test_dispatch_rank_zero_implies_execute_rank_zero():
    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def f(self):
        return 1

    assert getattr(f, MAGIC_ATTR)["execute_mode"] is Execute.RANK_ZERO


@pytest.mark.parametrize("length,world,expected", [
    (4, 2, [0, 0]), (5, 2, [0, 1]), (1, 4, [0, 1, 1, 1]), (10, 4, [0, 0, 0, 2]), (7, 3, [0, 0, 2]), (0, 2, [0, 0]),
])
def test_padding_rows_per_rank(length, world, expected):
    assert padding_rows_per_rank(length, world) == expected


def test_register_only_records_metadata():
    def twice(self, data):
        return data.repeat(2, interleave=True)

    assert register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)(twice) is twice
    assert getattr(twice, MAGIC_ATTR)["dispatch_mode"] is Dispatch.DP_COMPUTE_PROTO


def test_rank_side_class_strips_padding_rows_with_repeat_factor():
    class W:
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def twice(self, data):
            return data.repeat(2, interleave=True)

        def plain(self):
            return "plain"

    chunk = DataProto.from_dict({"x": torch.arange(3)})
    ranked = rank_side_class(W)()
    out = ranked.twice(chunk, **{SHARD_KWARG: {"rank": 1, "world_size": 2, "pad_rows": 2}})
    assert out.batch["x"].tolist() == [0, 0]  # the last two input rows were padding
    assert isinstance(ranked, W) and ranked.plain() == "plain"
    # The class as written is untouched: called directly, the method behaves as written.
    assert len(W().twice(chunk)) == 6
