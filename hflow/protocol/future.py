"""DataProtoFuture: the not-yet-collected output of a non-blocking worker-group call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from hflow.protocol.data_proto import DataProto

if TYPE_CHECKING:
    import ray

def _take_chunk(
    data: DataProto, chunks: int, index: int, previous: Callable[[DataProto], DataProto] | None
) -> DataProto:
    """Chunk ``index`` of ``data`` (after an earlier dispatch_fn, if any)."""
    if previous is not None:
        data = previous(data)
    return data.chunk(chunks)[index]


@dataclass
class DataProtoFuture:
    """The not-yet-collected output of a non-blocking worker-group call.

    Meant to be passed straight into another worker group's method, which resolves it on the
    workers: ``get()`` fetches all refs, collects them and applies ``dispatch_fn`` (e.g. take one chunk).
    """

    collect_fn: Callable[[list[DataProto]], DataProto]
    futures: list[ray.ObjectRef]
    dispatch_fn: Callable[[DataProto], DataProto] | None = None

    @staticmethod
    def concat(data: list[ray.ObjectRef]) -> DataProtoFuture:
        return DataProtoFuture(collect_fn=DataProto.concat, futures=data)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures over the same refs; future i resolves to chunk i of the collected data."""
        return [
            DataProtoFuture(
                collect_fn=self.collect_fn,
                futures=self.futures,
                dispatch_fn=partial(_take_chunk, chunks=chunks, index=i, previous=self.dispatch_fn),
            )
            for i in range(chunks)
        ]

    def get(self) -> DataProto:
        import ray

        outputs = ray.get(self.futures)
        for rank, output in enumerate(outputs):
            if not isinstance(output, DataProto):
                raise TypeError(
                    f"DataProtoFuture.get: ref {rank} resolved to a {type(output).__name__}, not a DataProto"
                )
        output = self.collect_fn(outputs)
        if self.dispatch_fn is not None:
            output = self.dispatch_fn(output)
        return output
