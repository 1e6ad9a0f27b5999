"""DataProto: the batch that flows between the single controller and the worker groups.

The contract lives here: import every name from ``hflow.protocol``. The modules behind it:

* ``data_proto``: DataProto and DataProtoItem (construction, indexing, keys, combining, pickling);
* ``columns``: DataProtoError, DataProtoConfig and the helpers that convert, compare and merge columns
  (``union_tensor_dict``, ``union_numpy_dict``, ...);
* ``wire``: the pickled form, every tensor of a batch in one byte buffer;
* ``batching``: pad/unpad to a divisor, fold/unfold a batch dim, ``collate_fn``, the cross-rank gather;
* ``future``: DataProtoFuture, the output of a non-blocking worker-group call.
"""

from hflow.protocol.batching import (
    all_gather_data_proto,
    collate_fn,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unpad_dataproto,
)
from hflow.protocol.columns import (
    DataProtoConfig,
    DataProtoError,
    list_of_dict_to_dict_of_list,
    union_numpy_dict,
    union_tensor_dict,
)
from hflow.protocol.data_proto import DataProto, DataProtoItem
from hflow.protocol.future import DataProtoFuture

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoError",
    "DataProtoFuture",
    "DataProtoItem",
    "all_gather_data_proto",
    "collate_fn",
    "fold_batch_dim",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]
