"""Reward-model training, stage 2 of the RLHF pipeline:

    python -m hflow.trainer.main_rm data.train_files=pairs.parquet data.val_files=val.parquet model.path=/models/sft

Pairwise rows (prompt, chosen, rejected) train with -log sigmoid(r_chosen - r_rejected); K-way rows
(prompt, responses, label) with the softmax cross-entropy over the K rewards. The output is a Hugging
Face sequence-classification folder that `reward_model.model.path` of main_ppo loads as it is. With no
data or model given it trains on the built-in RLHF task's preference pairs. Configuration:
`config/rm_trainer.yaml`.
"""

from __future__ import annotations

from omegaconf import DictConfig

from hflow.trainer.main_ppo import hflow_main, run_cli
from hflow.trainer.supervised_trainer import run_stage


def run_rm(config: DictConfig, user_keys: frozenset[str] = frozenset()) -> dict[str, float]:
    return run_stage(config, "rm", user_keys)


@hflow_main("rm_trainer")
def main(config: DictConfig) -> None:
    run_cli(run_rm, config)


if __name__ == "__main__":
    main()
