"""Supervised fine-tuning, stage 1 of the RLHF pipeline:

    python -m hflow.trainer.main_sft data.train_files=train.parquet data.val_files=val.parquet model.path=/models/base

The loss counts assistant tokens only, summed and divided by the number of trained tokens in the whole
global batch. With no data or model given it fine-tunes the built-in model on the built-in RLHF task's
demonstrations. Configuration: `config/sft_trainer.yaml`.
"""

from __future__ import annotations

from omegaconf import DictConfig

from hflow.trainer.main_ppo import hflow_main, run_cli
from hflow.trainer.supervised_trainer import run_stage


def run_sft(config: DictConfig, user_keys: frozenset[str] = frozenset()) -> dict[str, float]:
    return run_stage(config, "sft", user_keys)


@hflow_main("sft_trainer")
def main(config: DictConfig) -> None:
    run_cli(run_sft, config)


if __name__ == "__main__":
    main()
