"""Direct preference optimisation, a stage beside SFT and reward-model training:

    python -m hflow.trainer.main_dpo data.train_files=pairs.parquet data.val_files=val.parquet model.path=/models/sft

Rows are preference pairs (prompt, chosen, rejected; the replies as text or as chat messages). The policy
starts from `model.path` and is trained against a frozen copy of it, the reference, with the sigmoid
loss -log sigmoid(beta h) (h: the policy's log-ratio to the reference for the chosen reply minus that
for the rejected one), cDPO's label smoothing or IPO's squared loss (`dpo.*`). The output is a Hugging
Face causal-LM folder that main_ppo loads as it is (actor and reference). With no data or model given
it trains the built-in model on the built-in RLHF task's preference pairs. Configuration:
`config/dpo_trainer.yaml`.
"""

from __future__ import annotations

from omegaconf import DictConfig

from hflow.trainer.main_ppo import hflow_main, run_cli
from hflow.trainer.supervised_trainer import run_stage


def run_dpo(config: DictConfig, user_keys: frozenset[str] = frozenset()) -> dict[str, float]:
    return run_stage(config, "dpo", user_keys)


@hflow_main("dpo_trainer")
def main(config: DictConfig) -> None:
    run_cli(run_dpo, config)


if __name__ == "__main__":
    main()
