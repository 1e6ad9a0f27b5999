"""`data.streaming=true`: training prompts read lazily, shuffled in a buffer, resumed at the exact row.

The files are never held whole: rows come piece by piece (`sources.iter_tables`: parquet row groups, blocks of
JSON lines, Arrow record batches), pass through a shuffle buffer of `data.shuffle_buffer` rows, and are encoded as
`RLHFDataset` encodes them (the same template, truncation, tools and ``index``) only when they reach a batch.

At construction one pass over the files, before any worker starts, does what the in-memory dataset does at load:
`check_prompt_table` on every piece (a bad row stops the run naming its file and row), the row count, and the
prompt lengths: with ``data.filter_overlong_prompts`` the overlong rows' numbers are kept (a set of ints) and those
rows are skipped when read; without it and with ``data.truncation=error`` an overlong prompt stops the run there.
So an epoch's length is known: ``kept rows // data.train_batch_size`` batches (the last incomplete one dropped).

The order of epoch ``e`` is a pure function of ``(data.seed, e)``: the files in a seeded order (with
``data.mixture``: each row from a file drawn by weight, as many draws as rows), and the buffer's draws, from one
generator seeded so. The state saved in a checkpoint is the epoch, the rows of it handed out
and the rows read from each file by then; a resumed loader replays the epoch's reads and draws up to that point
without encoding a row (reading, not tokenizing: cheap next to the training it resumes), checks that it read as many
rows from each file as the saved state says, and its next batch is the uninterrupted run's next batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from omegaconf import DictConfig

from hflow.utils.dataset.config import mixture_weights
from hflow.utils.dataset.dataloader import check_same_data
from hflow.utils.dataset.rl_dataset import RLHFDataset, check_prompt_table
from hflow.utils.dataset.rl_dataset import collate_fn as default_collate_fn
from hflow.utils.dataset.sources import iter_tables, resolve_files
from hflow.utils.errors import ConfigError, DataError

__all__ = ["StreamedPrompts", "StreamingDataLoader"]


class StreamedPrompts(RLHFDataset):
    """The files of a streamed data key, checked and counted in one lazy pass; `rows(epoch)` yields their rows in
    the epoch's order. Items are `RLHFDataset.encode_row`'s; a sample's number is its position in the files
    (file starts + row), which names its file and row in errors."""

    def __init__(self, data_files: str | os.PathLike | Sequence[str | os.PathLike], tokenizer: Any,
                 config: DictConfig, files_key: str = "data.train_files", tools: Sequence[dict] | None = None,
                 processor: Any = None) -> None:
        self._configure(tokenizer, config, files_key, tools, processor)
        self.files = resolve_files(data_files, files_key)
        self.shuffle = bool(config.shuffle)
        self.seed = int(config.seed)
        self.buffer_size = int(config.shuffle_buffer) if self.shuffle else 1
        if self.buffer_size < 1:
            raise ConfigError(f"data.shuffle_buffer={config.shuffle_buffer}; it must be at least 1")
        self.has_images = False
        self._kept = None
        self._file_starts: list[int] = []
        self.dropped: set[int] = set()  # overlong samples (data.filter_overlong_prompts), skipped when read
        filter_overlong = bool(config.filter_overlong_prompts)
        total = 0
        for path in self.files:
            self._file_starts.append(total)
            for piece in self._pieces(path):
                check_prompt_table(piece, path, files_key, self.prompt_key, self.reward_fn_key,
                                   first_row=total - self._file_starts[-1])
                if self.image_key in piece.column_names:
                    raise ConfigError(f"{files_key}: {path} has images (column {self.image_key!r}, data.image_key); "
                                      "data.streaming=true reads text prompts only for now: set data.streaming=false")
                if filter_overlong:
                    lengths = self._lengths(piece, total)
                    self.dropped.update(total + i for i, n in enumerate(lengths) if n > self.max_prompt_length)
                elif self.truncation == "error":
                    self._check_lengths(piece, total)
                total += piece.num_rows
        self.num_rows = total
        self.num_filtered = len(self.dropped)
        if total - self.num_filtered == 0:
            raise DataError(f"{files_key} ({', '.join(self.files)}): no prompts to train on ({total} rows, "
                            f"{self.num_filtered} longer than data.max_prompt_length={self.max_prompt_length})")
        self.weights = mixture_weights(config) if files_key == "data.train_files" else None
        if self.weights is not None:
            ends = self._file_starts[1:] + [total]
            for file, (start, end) in enumerate(zip(self._file_starts, ends)):
                if not any(sample not in self.dropped for sample in range(start, end)):
                    raise ConfigError(f"data.mixture[{file}] weighs {self.files[file]}, which has no rows left (after "
                                      "data.filter_overlong_prompts); drop it from data.train_files and data.mixture")

    def __len__(self) -> int:
        """Samples per epoch (rows less the filtered ones)."""
        return self.num_rows - self.num_filtered

    def __getitem__(self, index: int) -> dict[str, Any]:
        raise TypeError("streamed prompts are read in order (StreamingDataLoader), not by index")

    def _pieces(self, path: str) -> Iterator[Any]:
        return iter_tables(path, self.files_key, split=self.split, split_key=self.split_key)

    def rows(self, epoch: int, read: list[int]) -> Iterator[tuple[int, dict[str, Any]]]:
        """(sample number, row) of epoch `epoch`'s kept rows, in its order; `read[f]` counts the rows read from
        file f so far (updated in place, as the reading goes)."""
        rng = np.random.default_rng([self.seed, epoch])
        buffer: list[tuple[int, dict[str, Any]]] = []
        for entry in self._source(rng, read):
            if len(buffer) < self.buffer_size:
                buffer.append(entry)
                continue
            slot = int(rng.integers(self.buffer_size))  # a random held row out, the new one in its place
            out, buffer[slot] = buffer[slot], entry
            yield out
        for slot in rng.permutation(len(buffer)):  # the end of the data: what the buffer holds, in random order
            yield buffer[slot]

    def _source(self, rng: np.random.Generator, read: list[int]) -> Iterator[tuple[int, dict[str, Any]]]:
        """The rows before the buffer: the files one after the other (in a seeded order with data.shuffle), or with
        data.mixture `len(self)` draws, each from a file picked by weight: its next row, from its start again when
        used up (as `MixtureSampler` walks a file in memory)."""
        if self.weights is None:
            for file in rng.permutation(len(self.files)) if self.shuffle else range(len(self.files)):
                yield from self._file_rows(file, read)
            return
        streams = [self._file_rows(file, read) for file in range(len(self.files))]
        chance = np.asarray(self.weights) / sum(self.weights)
        for _ in range(len(self)):
            file = int(rng.choice(len(self.files), p=chance))
            entry = next(streams[file], None)
            if entry is None:
                streams[file] = self._file_rows(file, read)
                entry = next(streams[file])
            yield entry

    def _file_rows(self, file: int, read: list[int]) -> Iterator[tuple[int, dict[str, Any]]]:
        """(sample number, row) of one file's kept rows, in the file's order, piece by piece."""
        sample = self._file_starts[file]
        for piece in self._pieces(self.files[file]):
            for row in piece.to_pylist():
                read[file] += 1
                sample += 1
                if sample - 1 not in self.dropped:
                    yield sample - 1, row


class StreamingDataLoader:
    """`ResumableDataLoader`'s interface over `StreamedPrompts`: ``iter()`` runs the rest of the current epoch in
    batches of `batch_size` (the incomplete last one dropped), `state_dict` / `load_state_dict` save and restore the
    exact position."""

    def __init__(self, prompts: StreamedPrompts, batch_size: int,
                 collate_fn: Callable[[list[Any]], Any] = default_collate_fn) -> None:
        self.dataset = prompts
        self.batch_size = int(batch_size)
        self.collate_fn = collate_fn
        if self.batch_size < 1 or len(self) == 0:
            raise ConfigError(
                f"data.train_batch_size={batch_size} is more than the {len(prompts)} rows of {prompts.files_key} "
                f"({', '.join(prompts.files)})" + (f" after data.filter_overlong_prompts dropped {prompts.num_filtered}"
                                                   if prompts.num_filtered else "")
                + "; lower data.train_batch_size (and the mini-batch sizes with it) or add data")
        self._epoch = 0
        self._rows_done = 0  # samples of this epoch handed out
        self._read = [0] * len(prompts.files)  # rows read from each file this epoch, when they were

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.dataset) // self.batch_size

    @property
    def epoch(self) -> int:
        self._roll_over()
        return self._epoch

    def __iter__(self) -> Iterator[Any]:
        self._roll_over()
        read = [0] * len(self.dataset.files)
        rows = self.dataset.rows(self._epoch, read)
        for _ in range(self._rows_done):  # the replay: the reads and draws before the saved position
            next(rows)
        if self._rows_done and read != self._read:
            raise ConfigError(
                f"data.streaming: the saved position ({self._rows_done} rows of epoch {self._epoch}, rows read per "
                f"file {self._read}) is not where the files lead now (rows read {read}): {self.dataset.files_key} changed "
                "since the checkpoint. Resume with the same files and data settings, or start fresh "
                "(trainer.resume_mode=disable)")
        while self._rows_done // self.batch_size < len(self):
            batch = [next(rows) for _ in range(self.batch_size)]
            self._rows_done += self.batch_size
            self._read = list(read)
            yield self.collate_fn([self.dataset.encode_row(row, sample) for sample, row in batch])
        self._roll_over()

    def state_dict(self) -> dict[str, Any]:
        self._roll_over()
        return {"streaming": True, "epoch": self._epoch, "rows_done": self._rows_done, "rows_read": list(self._read),
                "num_samples": len(self.dataset), "batch_size": self.batch_size, "shuffle": self.dataset.shuffle,
                "seed": self.dataset.seed, "shuffle_buffer": self.dataset.buffer_size,
                "mixture": self.dataset.weights}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        expected = self.state_dict()
        if not state.get("streaming"):
            raise ConfigError("the checkpoint's data loader was not streaming (data.streaming=false when it was saved); "
                              "resume with data.streaming=false, or start fresh (trainer.resume_mode=disable)")
        check_same_data(state, expected, ("num_samples", "batch_size", "shuffle", "seed", "shuffle_buffer", "mixture"))
        self._epoch, self._rows_done, self._read = state["epoch"], state["rows_done"], list(state["rows_read"])
        self._roll_over()

    def _roll_over(self) -> None:
        if self._rows_done // self.batch_size >= len(self):
            self._epoch += 1
            self._rows_done = 0
            self._read = [0] * len(self.dataset.files)
