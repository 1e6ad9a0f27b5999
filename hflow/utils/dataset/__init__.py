"""RL prompt data: the parquet dataset, its collate function and a resumable data loader."""

from hflow.utils.dataset.dataloader import (
    ResumableDataLoader,
    SeededEpochSampler,
    create_rl_sampler,
    create_train_dataloader,
)
from hflow.utils.dataset.rl_dataset import RLHFDataset, collate_fn

__all__ = [
    "RLHFDataset",
    "ResumableDataLoader",
    "SeededEpochSampler",
    "collate_fn",
    "create_rl_sampler",
    "create_train_dataloader",
]
