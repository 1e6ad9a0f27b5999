"""The `data` sections: PPO's prompts (`config/ppo_trainer.yaml`) and the supervised stages' sequences
(`config/sft_trainer.yaml`, `config/rm_trainer.yaml`, `config/dpo_trainer.yaml`), their typed defaults (comments in the YAML) and
their checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hflow.config_schema import ConfigError, check_choice
from hflow.utils.dataset.rl_dataset import TRUNCATION_MODES


@dataclass
class DataConfig:
    train_files: Any = None  # a parquet file or a list of them; None = the built-in task
    val_files: Any = None
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

    train_files: Any = None  # None = the built-in RLHF task's data for the stage
    val_files: Any = None
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
    """`key` names one parquet file or a list of them, each a file that exists."""
    files = data_files(value)
    if not files:
        raise ConfigError(f"{key} is empty; give one parquet file or a list of them")
    for path in files:
        if Path(str(path)).expanduser().is_dir():
            raise ConfigError(f"{key}: {path} is a folder; give the parquet files in it "
                              f"(a list: {key}=[a.parquet,b.parquet])")
        if not Path(str(path)).expanduser().is_file():
            raise ConfigError(f"{key}: file {path} does not exist")


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
