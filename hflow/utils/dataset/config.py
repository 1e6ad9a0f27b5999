"""The `data` sections: PPO's prompts (`config/ppo_trainer.yaml`) and the supervised stages' sequences
(`config/sft_trainer.yaml`, `config/rm_trainer.yaml`, `config/dpo_trainer.yaml`), their typed defaults (comments in the YAML) and
their checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hflow.config_schema import ConfigError, check_choice
from hflow.utils.dataset.rl_dataset import TRUNCATION_MODES
from hflow.utils.dataset.sources import FORMATS, file_format


@dataclass
class DataConfig:
    train_files: Any = None  # a data file or a list: parquet, JSON lines, save_to_disk folders; None = the built-in task
    val_files: Any = None
    train_split: str = "train"  # the split read from a DatasetDict save_to_disk folder in train_files (TRL's default)
    val_split: str = "test"  # ... in val_files
    mixture: Any = None  # a weight per train_files entry, in their order: file i drawn w_i / sum(w); None = each row once
    streaming: bool = False  # read the training rows lazily, file piece by piece, shuffled in a buffer (no full load)
    shuffle_buffer: int = 1024  # streaming: rows held and drawn from at random (data.shuffle); 1 = file order
    builtin_task: Optional[str] = None  # with no data or model: None = arithmetic (agent with multi_turn) | vault... | vision_digits...
    prompt_key: str = "prompt"
    image_key: str = "images"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 128
    max_response_length: int = 64
    train_batch_size: int = 32  # prompts per training step
    val_batch_size: Optional[int] = None
    truncation: str = "error"
    filter_overlong_prompts: bool = True
    return_raw_chat: bool = False
    shuffle: bool = True
    seed: int = 1
    dataloader_num_workers: int = 0
    chat_template: Optional[str] = None
    ptx_files: Any = None  # PPO-ptx pre-training text: a parquet file or a list of them
    ptx_text_key: str = "text"


@dataclass
class StageDataConfig:
    """What the supervised stages' `data` share."""

    train_files: Any = None  # None = the built-in RLHF task's data for the stage; parquet, JSON lines or save_to_disk folders
    val_files: Any = None
    train_split: str = "train"  # the split read from a DatasetDict save_to_disk folder in train_files
    val_split: str = "test"  # ... in val_files
    prompt_key: str = "prompt"
    max_length: int = 256  # tokens per sequence (prompt + response)
    truncation: str = "error"  # error | right (SFT) / left (reward model)
    train_batch_size: int = 32  # sequences (SFT) or preference groups (RM) per optimizer step, global
    micro_batch_size_per_gpu: int = 8
    val_batch_size: Optional[int] = None  # None = the whole validation set at once
    shuffle: bool = True
    seed: int = 1
    dataloader_num_workers: int = 0
    chat_template: Optional[str] = None


@dataclass
class SFTDataConfig(StageDataConfig):
    messages_key: str = "messages"
    response_key: str = "response"


@dataclass
class RMDataConfig(StageDataConfig):
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    responses_key: str = "responses"
    label_key: str = "label"


@dataclass
class DPODataConfig(StageDataConfig):
    chosen_key: str = "chosen"  # text, or chat messages ending with the assistant's reply
    rejected_key: str = "rejected"


def data_files(value: Any) -> list[str]:
    """A `*_files` key's value as a list (None: none)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def check_data_files(value: Any, key: str) -> None:
    """`key` names one data file or a list of them, each present and of a format the reader takes (`FORMATS`)."""
    files = data_files(value)
    if not files:
        raise ConfigError(f"{key} is empty; give one data file or a list of them ({FORMATS})")
    for path in files:
        if not Path(str(path)).expanduser().exists():
            raise ConfigError(f"{key}: file {path} does not exist")
        try:
            file_format(Path(str(path)).expanduser(), key)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def mixture_weights(data: Any) -> list[float] | None:
    """`data.mixture` checked against `data.train_files`: one positive number per file, in their order."""
    weights = data.get("mixture") if hasattr(data, "get") else getattr(data, "mixture", None)
    if weights is None:
        return None
    files = data_files(data.train_files)
    if isinstance(weights, (str, int, float)) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
        raise ConfigError(f"data.mixture={weights!r}: give a list of numbers, one weight per data.train_files entry "
                          f"in their order, e.g. data.mixture=[3,1] for two files")
    weights = [float(w) for w in weights]
    if len(weights) != len(files):
        raise ConfigError(f"data.mixture has {len(weights)} weights but data.train_files has {len(files)} files; give "
                          "one weight per file, in their order")
    bad = [i for i, w in enumerate(weights) if not w > 0 or w == float("inf")]
    if bad:
        raise ConfigError(f"data.mixture[{bad[0]}]={weights[bad[0]]} (for {files[bad[0]]}): every weight must be a "
                          "positive finite number; drop the file from data.train_files instead of weighting it 0")
    return weights


# data.builtin_task's values (hflow.tasks.vault_task.BUILTIN_TASKS and hflow.tasks.vision_task.BUILTIN_TASKS;
# tasks sit above this layer)
BUILTIN_TASKS = ("vault", "vault_reset_every_turn", "vault_shuffled", "vision_digits", "vision_digits_blanked")


def check_data(data: Any) -> None:
    """PPO's `data`: the truncation mode, the built-in task and the files (sizes are checked with the other sizes)."""
    check_choice(data.truncation, TRUNCATION_MODES, "data.truncation")
    if data.builtin_task is not None:
        check_choice(data.builtin_task, BUILTIN_TASKS, "data.builtin_task")
    check_data_files(data.train_files, "data.train_files")
    check_data_files(data.val_files, "data.val_files")
    mixture_weights(data)
    if int(data.shuffle_buffer) < 1:
        raise ConfigError(f"data.shuffle_buffer={data.shuffle_buffer}; it must be at least 1 (1 = the files' order)")
    if data.streaming and int(data.dataloader_num_workers) > 0:
        raise ConfigError(f"data.streaming=true reads rows in the driver; set data.dataloader_num_workers=0 (it is "
                          f"{data.dataloader_num_workers})")
