"""Impossible configurations fail fast (before Ray or any model), with a message naming the keys."""

import json
import time
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from hflow import CONFIG_DIR
from hflow.trainer.preflight import preflight_check
from hflow.workers.config import ConfigError


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer_config.json").write_text("{}")
    rows = pd.DataFrame({"data_source": ["openai/gsm8k", "hflow/arithmetic"]})
    for name in ("train.parquet", "val.parquet"):
        rows.to_parquet(root / name)
    pd.DataFrame({"data_source": ["my/own_task"]}).to_parquet(root / "custom.parquet")
    (root / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    return root


def make_config(files: Path, *overrides: str):
    base = [
        f"actor_rollout_ref.model.path={files / 'model'}",
        f"data.train_files={files / 'train.parquet'}",
        f"data.val_files={files / 'val.parquet'}",
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.n_gpus_per_node=2",
    ]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=base + list(overrides))


def test_the_base_config_passes(files):
    preflight_check(make_config(files))
    preflight_check(make_config(files, "algorithm.adv_estimator=grpo"))


INVALID = [
    (["data.train_batch_size=3", "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=3"],
     ["data.train_batch_size", "actor_rollout_ref.rollout.n", "n_gpus_per_node"]),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=16"], ["ppo_mini_batch_size", "data.train_batch_size"]),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], ["ppo_micro_batch_size_per_gpu"]),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], ["tensor_model_parallel_size"]),
    (["critic.model.path=null"], ["critic.model.path", "gae"]),
    (["data.train_files=/nonexistent/train.parquet"], ["data.train_files", "/nonexistent/train.parquet"]),
    (["actor_rollout_ref.model.path=/nonexistent/model"], ["actor_rollout_ref.model.path"]),
    (["algorithm.adv_estimator=ppo2"], ["algorithm.adv_estimator", "grpo"]),
    (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=8",
      "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
     ["actor_rollout_ref.rollout.n"]),
    (["actor_rollout_ref.actor.loss_agg_mode=mean"], ["loss_agg_mode"]),
    (["actor_rollout_ref.rollout.name=sglang"], ["actor_rollout_ref.rollout.name"]),
    (["data.max_prompt_length=500", "data.max_response_length=100"], ["max_prompt_length", "max_position_embeddings"]),
    (["trainer.logger=[console,neptune]"], ["trainer.logger", "neptune"]),
    (["trainer.resume_mode=resume_path"], ["trainer.resume_from_path"]),
    (["custom_reward_function.path=/nonexistent/reward.py"], ["custom_reward_function.path"]),
    (["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k9"], ["kl_loss_type"]),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=trpo"], ["loss_mode"]),
    (["trainer.n_gpus_per_node=0"], ["n_gpus_per_node"]),
    (["trainer.cpus_per_worker=0"], ["trainer.cpus_per_worker"]),
    (["algorithm.reuse_update_log_probs=true", "actor_rollout_ref.actor.ppo_epochs=2"],
     ["algorithm.reuse_update_log_probs", "ppo_epochs"]),
    (["algorithm.rollout_check_freq=-1"], ["algorithm.rollout_check_freq=-1"]),
    (["trainer.health.enable=true", "trainer.health.snapshot=checkpoint"], ["trainer.save_freq"]),
    (["trainer.cpus_per_worker=3", "ray_init.num_cpus=4"], ["trainer.cpus_per_worker=3", "6 CPUs", "ray_init.num_cpus"]),
    # placement: no device left for training, TP not dividing the rollout pool, async without its own devices
    (["trainer.placement=split", "trainer.rollout_n_gpus=2"], ["trainer.rollout_n_gpus=2", "between 1 and 1"]),
    (["trainer.placement=split", "trainer.n_gpus_per_node=4", "trainer.rollout_n_gpus=3",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], ["tensor_model_parallel_size", "rollout_n_gpus (3)"]),
    (["trainer.placement=split", "trainer.n_gpus_per_node=4", "trainer.rollout_n_gpus=1"],
     ["training pool's 3 ranks", "trainer.rollout_n_gpus"]),
    (["trainer.placement=spread"], ["trainer.placement", "colocate"]),
    (["trainer.async_steps=1"], ["trainer.async_steps=1", "trainer.placement=split"]),
    (["trainer.async_steps=2", "trainer.placement=split"],
     ["trainer.async_steps=2", "rollout.calculate_log_probs=true", "algorithm.rollout_is=token"]),
    (["trainer.async_steps=3", "trainer.placement=split", "actor_rollout_ref.rollout.calculate_log_probs=false"],
     ["trainer.async_steps=3", "calculate_log_probs=true"]),
    (["trainer.async_steps=-1", "trainer.placement=split"], ["trainer.async_steps", ">= 0"]),
    (["actor_rollout_ref.rollout.partial_rollout=true"], ["partial_rollout", "trainer.async_steps >= 1"]),
    (["trainer.placement=split", "trainer.async_steps=1", "algorithm.reuse_update_log_probs=true",
      "actor_rollout_ref.actor.ppo_mini_batch_size=8"], ["trainer.async_steps=1", "algorithm.reuse_update_log_probs"]),
    (["trainer.placement=split", "actor_rollout_ref.rollout.name=hf"], ["trainer.placement=split", "rollout.name"]),
    (["trainer.placement=split", "trainer.backend=local", "trainer.n_gpus_per_node=1"], ["trainer.backend"]),
    # lengths and sizes that must be positive (else a division by zero, or a failure in a worker or a library)
    (["data.max_prompt_length=0"], ["data.max_prompt_length", "positive"]),
    (["data.max_response_length=-1"], ["data.max_response_length", "positive"]),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=0"], ["actor_rollout_ref.actor.ppo_mini_batch_size", "positive"]),
    (["actor_rollout_ref.actor.ppo_epochs=0"], ["actor_rollout_ref.actor.ppo_epochs"]),
    (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0"], ["rollout.log_prob_micro_batch_size_per_gpu"]),
    (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=0"],
     ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]),
    (["actor_rollout_ref.rollout.val_kwargs.n=0"], ["actor_rollout_ref.rollout.val_kwargs.n"]),
    (["data.val_batch_size=-1"], ["data.val_batch_size"]),
    (["data.dataloader_num_workers=-1"], ["data.dataloader_num_workers"]),
]


@pytest.mark.parametrize("overrides,named", INVALID, ids=[o[0] for o, _ in INVALID])
def test_invalid_config_fails_fast_naming_the_keys(files, overrides, named):
    config = make_config(files, *overrides)
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        preflight_check(config)
    assert time.monotonic() - start < 5
    for word in named:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def test_unknown_data_source_fails_naming_it_unless_a_custom_function_is_set(files):
    config = make_config(files, f"data.val_files={files / 'custom.parquet'}")
    with pytest.raises(ConfigError, match="my/own_task.*custom_reward_function.path"):
        preflight_check(config)
    preflight_check(make_config(files, f"data.val_files={files / 'custom.parquet'}",
                                f"custom_reward_function.path={files / 'reward.py'}"))


def test_a_reward_file_that_does_not_import_or_lacks_the_function_fails_in_preflight(files):
    """Before the tokenizer and the data load: the file is imported by the preflight."""
    from hflow.utils.errors import UserError

    broken = files / "broken_reward.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(UserError, match=r"custom_reward_function\.path=.*broken_reward\.py.*SyntaxError"):
        preflight_check(make_config(files, f"custom_reward_function.path={broken}"))
    with pytest.raises(UserError, match=r"custom_reward_function\.name='score'.*reward\.py.*\['compute_score'\]"):
        preflight_check(make_config(files, f"custom_reward_function.path={files / 'reward.py'}",
                                    "custom_reward_function.name=score"))


def test_split_placement_passes_and_divides_the_nodes(files):
    from hflow.trainer.config import placement_pools

    preflight_check(make_config(files, "trainer.placement=split", "trainer.rollout_n_gpus=1"))
    preflight_check(make_config(files, "trainer.placement=split", "trainer.async_steps=1"))
    preflight_check(make_config(files, "trainer.placement=split", "trainer.async_steps=4", "algorithm.rollout_is=token",
                                "actor_rollout_ref.rollout.partial_rollout=true"))
    # the rollout pool takes its devices from the last nodes; training keeps whole nodes first
    assert placement_pools(1, 8, "colocate", 3) == ([8], [])
    assert placement_pools(1, 8, "split", 4) == ([4], [4])
    assert placement_pools(2, 8, "split", 4) == ([8, 4], [4])
    assert placement_pools(2, 8, "split", 10) == ([6], [2, 8])
    assert placement_pools(2, 1, "split", 1) == ([1], [1])
