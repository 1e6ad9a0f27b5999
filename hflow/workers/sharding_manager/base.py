"""The interface between a training engine and a rollout engine that live in one worker process."""

from __future__ import annotations

from types import TracebackType

from hflow.protocol import DataProto

__all__ = ["BaseShardingManager"]


class BaseShardingManager:
    """A context manager that puts a worker in generation mode (`__enter__`) and back in training mode
    (`__exit__`), plus the data reshuffle between the two layouts.

    Training shards the batch over all data-parallel ranks; a rollout engine may instead expect every
    rank of a tensor-parallel group to hold the same prompts. `preprocess_data` turns the former into
    the latter and `postprocess_data` back. This base class does nothing, for engines that share the
    training layout.
    """

    def __enter__(self) -> BaseShardingManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None

    def preprocess_data(self, data: DataProto) -> DataProto:
        return data

    def postprocess_data(self, data: DataProto) -> DataProto:
        return data
