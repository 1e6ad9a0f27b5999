"""Pre-training text for PPO-ptx: the language-modelling batches mixed into every actor optimizer step.

InstructGPT's PPO-ptx (and DeepSpeed-Chat's "unsupervised" loss) adds `coef x` the next-token NLL of
text from the pre-training distribution to the PPO objective, so that RL does not erode what the model
already knew. The text is a column of one or more parquet files (`data.ptx_files`,
`data.ptx_text_key`). Each rank draws its own batch for each step, with replacement, from a generator
seeded by (seed, rank): the draws differ between ranks, repeat exactly for the same seed, and resume
where they stopped (`state_dict`). Only the drawn rows are tokenised, so a large corpus costs its
Arrow column in memory and nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from tensordict import TensorDict

from hflow.utils.dataset.sources import count_rows, read_schema, read_table, resolve_files
from hflow.utils.errors import DataError

__all__ = ["PtxSampler", "check_ptx_files", "ptx_loss_mask"]

FILES_KEY = "data.ptx_files"
TEXT_KEY = "data.ptx_text_key"


def _file_list(files: Any) -> list[str]:
    if files is None:
        return []
    return [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]


def check_ptx_files(files: Any, text_key: str) -> list[Path]:
    """The parquet files of `data.ptx_files`, each present, with a `text_key` column and at least one row;
    a `DataError` naming the key, the file and the column otherwise. Reads only the footers."""
    paths = [Path(f).expanduser() for f in _file_list(files)]
    if not paths:
        raise DataError(f"{FILES_KEY} is not set: PPO-ptx (actor_rollout_ref.actor.ptx.coef > 0) needs pre-training "
                        "text, one data file or a list of them")
    for path in paths:
        if not path.exists():
            raise DataError(f"{FILES_KEY}: file {path} does not exist")
        resolve_files(str(path), FILES_KEY)  # a format the reader takes
        schema = read_schema(path, FILES_KEY)
        if text_key not in schema.names:
            raise DataError(f"{FILES_KEY}: {path} has no column {text_key!r} ({TEXT_KEY}); its columns are "
                            f"{', '.join(schema.names)}")
        if count_rows(path, FILES_KEY) == 0:
            raise DataError(f"{FILES_KEY}: {path} has no rows")
    return paths


def ptx_loss_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T-1) mask of the predicted tokens: position t predicts token t+1, and both must be text
    (not padding, on either side)."""
    return attention_mask[:, :-1] * attention_mask[:, 1:]


class PtxSampler:
    """Batches of `batch_size` tokenised texts (at most `max_length` tokens each, longer ones cut at the
    end), right-padded: `input_ids`, `attention_mask`, `position_ids` (B, T)."""

    def __init__(self, files: Any, text_key: str, tokenizer, batch_size: int, max_length: int, seed: int,
                 rank: int = 0) -> None:
        paths = check_ptx_files(files, text_key)
        column = pa.concat_arrays([
            chunk for path in paths for chunk in read_table(path, FILES_KEY, columns=[text_key]).column(0).chunks
        ])
        self.texts = column
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        # Seeded by (seed, rank): every rank draws its own rows, the same ones on every run with this seed.
        self.generator = torch.Generator().manual_seed((int(seed) << 16) + int(rank))

    def __len__(self) -> int:
        return len(self.texts)

    def draw_indices(self) -> list[int]:
        return torch.randint(len(self.texts), (self.batch_size,), generator=self.generator).tolist()

    def tokenize(self, texts: Sequence[str]) -> TensorDict:
        encoded = self.tokenizer(list(texts), truncation=True, max_length=self.max_length, add_special_tokens=True)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # At least 2 columns: every rank runs the same forwards (FSDP's collectives), even on texts of one token.
        width = max(2, max(len(ids) for ids in encoded["input_ids"]))
        input_ids = torch.full((len(texts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(texts), width), dtype=torch.long)
        for row, ids in enumerate(encoded["input_ids"]):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        position_ids = torch.clamp(attention_mask.cumsum(-1) - 1, min=0)
        return TensorDict({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
                          batch_size=[len(texts)])

    def next_batch(self) -> TensorDict:
        """This rank's batch for the next optimizer step."""
        indices = self.draw_indices()
        texts = ["" if text is None else str(text) for text in self.texts.take(pa.array(indices)).to_pylist()]
        return self.tokenize(texts)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])
