"""hflow: RL post-training of language models in the HybridFlow style (see README.md)."""

from pathlib import Path

# The Hydra configuration folder shipped inside the package (ppo_trainer.yaml, sft_trainer.yaml, ...).
CONFIG_DIR = str(Path(__file__).resolve().parent / "config")
