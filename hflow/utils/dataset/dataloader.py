"""A data loader whose position can be saved in a checkpoint and restored exactly.

The order of epoch ``e`` is a pure function of ``(seed, e)``: a permutation drawn from a generator
seeded with ``seed + e`` (or the identity without shuffling). The loader's whole state is therefore
two integers, the epoch and the number of batches of it already handed out, and a run resumed from
the state saved after step k yields exactly batches k+1, k+2, ... of the uninterrupted run, across
epoch boundaries too. (torchdata's StatefulDataLoader, tried with torch 2.13, restores the position
but not the order of later epochs when given a seeded RandomSampler.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from hflow.utils.dataset.config import mixture_weights
from hflow.utils.dataset.rl_dataset import collate_fn as default_collate_fn
from hflow.utils.errors import ConfigError

__all__ = ["MixtureSampler", "ResumableDataLoader", "SeededEpochSampler", "check_same_data", "create_rl_sampler",
           "create_train_dataloader"]


class SeededEpochSampler:
    """The order of every epoch: ``randperm(num_samples)`` seeded with ``seed + epoch``, or 0..n-1."""

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()


class MixtureSampler(SeededEpochSampler):
    """`data.mixture`'s order: each of an epoch's draws (as many as the samples) picks file i with probability
    ``w_i / sum(w)``, then that file's next sample. Each file's samples are walked in an order seeded per epoch
    (the files' order without ``data.shuffle``), from the start again when used up, so a small file weighted up is
    repeated and a large one weighted down is sampled. A pure function of ``(seed, epoch)`` like the parent's, so
    `ResumableDataLoader`'s state (epoch, batches done) resumes it exactly."""

    def __init__(self, item_files: list[int], weights: list[float], shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(len(item_files), shuffle=shuffle, seed=seed)
        self.weights = [float(w) for w in weights]
        files = torch.tensor(item_files, dtype=torch.long)
        self.members = [torch.nonzero(files == i).flatten() for i in range(len(self.weights))]
        empty = [i for i, members in enumerate(self.members) if len(members) == 0]
        if empty:
            raise ConfigError(f"data.mixture[{empty[0]}] weighs a file with no samples left (after "
                              "data.filter_overlong_prompts); drop it from data.train_files and data.mixture")

    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        picks = torch.multinomial(torch.tensor(self.weights), self.num_samples, replacement=True, generator=generator)
        order = torch.empty(self.num_samples, dtype=torch.long)
        for i, members in enumerate(self.members):
            where = torch.nonzero(picks == i).flatten()
            walk = members[torch.randperm(len(members), generator=generator)] if self.shuffle else members
            order[where] = walk[torch.arange(len(where)) % len(walk)]  # the file's k-th draw is its k-th sample
        return order.tolist()


def check_same_data(state: Mapping[str, Any], expected: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    """A saved loader state's `keys` equal this loader's, or the batches would not continue the interrupted run."""
    changed = [key for key in keys if state[key] != expected[key]]
    if changed:
        details = ", ".join(f"{key} {state[key]} → {expected[key]}" for key in changed)
        raise ConfigError(
            f"the data loader state was saved for different data ({details}); the batches would not continue the "
            "interrupted run. Resume with the same data.train_files, data.train_batch_size, data.shuffle, data.seed, "
            "data.mixture, data.shuffle_buffer and data.filter_overlong_prompts, or start fresh "
            "(trainer.resume_mode=disable)")


def create_rl_sampler(data_config: DictConfig, dataset: Dataset) -> SeededEpochSampler:
    """The training order: shuffled per epoch (``data.shuffle``) from ``data.seed``; with ``data.mixture``, drawn
    from the files by weight (`MixtureSampler`)."""
    weights = mixture_weights(data_config)
    if weights is not None:
        return MixtureSampler(dataset.item_files(), weights, shuffle=bool(data_config.shuffle),
                              seed=int(data_config.seed))
    return SeededEpochSampler(
        len(dataset), shuffle=bool(data_config.shuffle), seed=int(data_config.seed)
    )


class ResumableDataLoader:
    """Batches of `dataset` in the sampler's order; ``iter()`` runs the rest of the current epoch.

    Use it like a DataLoader, one ``for`` loop per epoch; after `load_state_dict` the first loop
    continues the interrupted epoch::

        for epoch in range(loader.epoch, total_epochs):
            for batch in loader:
                ...
                checkpoint["data"] = loader.state_dict()

    `num_workers > 0` loads batches in torch DataLoader worker processes; the position is still
    counted as batches reach the caller, so the state stays exact. One iterator at a time.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        sampler: SeededEpochSampler | None = None,
        collate_fn: Callable[[list[Any]], Any] = default_collate_fn,
        drop_last: bool = True,
        num_workers: int = 0,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler or SeededEpochSampler(len(dataset), shuffle=False)
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.num_workers = num_workers
        if len(self.sampler) != len(dataset):
            raise ValueError(f"the sampler covers {len(self.sampler)} samples but the dataset has {len(dataset)}")
        if batch_size < 1 or len(self) == 0:
            raise ValueError(
                f"batch size {batch_size} gives no batch from {len(dataset)} samples (drop_last={drop_last}); "
                "lower the batch size (data.train_batch_size / data.val_batch_size) or add data"
            )
        self._epoch = 0
        self._batches_done = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        count = len(self.dataset) / self.batch_size
        return math.floor(count) if self.drop_last else math.ceil(count)

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        self._roll_over()
        return self._epoch

    def __iter__(self) -> Iterator[Any]:
        self._roll_over()
        for batch in self._load(self._epoch_batches(self._epoch)[self._batches_done :]):
            # Counted before the caller sees the batch: a state saved while it is processed skips it.
            self._batches_done += 1
            yield batch
        self._roll_over()

    def state_dict(self) -> dict[str, Any]:
        self._roll_over()
        return {
            "epoch": self._epoch,
            "batches_done": self._batches_done,
            "num_samples": len(self.dataset),
            "batch_size": self.batch_size,
            "shuffle": self.sampler.shuffle,
            "seed": self.sampler.seed,
            "mixture": getattr(self.sampler, "weights", None),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        expected = self.state_dict()
        state = {"mixture": None, **state}  # saved before data.mixture existed: none
        check_same_data(state, expected, ("num_samples", "batch_size", "shuffle", "seed", "mixture"))
        self._epoch = state["epoch"]
        self._batches_done = state["batches_done"]
        self._roll_over()

    # ---- internals -------------------------------------------------------------------------------

    def _roll_over(self) -> None:
        if self._batches_done >= len(self):
            self._epoch += 1
            self._batches_done = 0

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        order = self.sampler.order(epoch)
        batches = [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        return batches[: len(self)]

    def _load(self, batches: list[list[int]]) -> Iterator[Any]:
        if self.num_workers == 0:
            return (self.collate_fn([self.dataset[i] for i in batch]) for batch in batches)
        return iter(
            DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn, num_workers=self.num_workers)
        )


def create_train_dataloader(
    dataset: Dataset,
    data_config: DictConfig,
    collate_fn: Callable[[list[Any]], Any] = default_collate_fn,
) -> ResumableDataLoader:
    """The training loader: ``data.train_batch_size`` prompts per batch in `create_rl_sampler` order,
    incomplete last batches dropped, loaded in ``data.dataloader_num_workers`` processes."""
    batch_size = int(data_config.train_batch_size)
    if len(dataset) < batch_size:
        files = ", ".join(map(str, getattr(dataset, "files", [])))
        filtered = getattr(dataset, "num_filtered", 0)
        dropped = f" after data.filter_overlong_prompts dropped {filtered}" if filtered else ""
        raise ConfigError(
            f"data.train_batch_size={batch_size} is more than the {len(dataset)} rows of data.train_files"
            f"{f' ({files})' if files else ''}{dropped}; lower data.train_batch_size (and the mini-batch sizes "
            "with it) or add data")
    return ResumableDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=create_rl_sampler(data_config, dataset),
        collate_fn=collate_fn,
        drop_last=True,
        num_workers=int(data_config.dataloader_num_workers),
    )
