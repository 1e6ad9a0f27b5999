"""RL prompt data: the dataset (parquet, JSON lines, save_to_disk folders: `sources`), its collate function and a
resumable data loader; `streaming` reads the training files lazily."""

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
