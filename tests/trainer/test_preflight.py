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


def test_two_sleep_mode_engines_never_share_a_process(files, pretend_cuda, monkeypatch):
    """On CUDA the rollout's and the judge's engines both sleep (vLLM's one-engine-per-process CuMem
    allocator): the local backend, one process for both, is refused naming the keys; on Ray the judge has
    a process of its own, and a judge without sleep mode may share."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # the node the config names
    judge = ["reward_model.enable=true", "reward_model.style=generative", f"reward_model.model.path={files / 'model'}"]
    judge.append("trainer.memory_plan=off")  # (it would ask the pretended GPU its memory)
    local = ["trainer.backend=local", "trainer.n_gpus_per_node=1"]
    with pytest.raises(ConfigError) as refused:
        preflight_check(make_config(files, *judge, *local))
    for key in ("trainer.backend=local", "actor_rollout_ref.rollout.free_cache_engine=true",
                "reward_model.judge.free_cache_engine=true", "trainer.backend=ray"):
        assert key in str(refused.value), str(refused.value)
    preflight_check(make_config(files, *judge))  # Ray: the judge in its own processes
    preflight_check(make_config(files, *judge, *local, "reward_model.judge.free_cache_engine=false"))
    preflight_check(make_config(files, *judge, *local, "actor_rollout_ref.rollout.name=hf"))  # no rollout engine


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
    (["actor_rollout_ref.rollout.admission=eager"], ["actor_rollout_ref.rollout.admission", "continuous"]),
    (["actor_rollout_ref.rollout.admission=continuous", "actor_rollout_ref.rollout.name=hf"],
     ["actor_rollout_ref.rollout.admission=continuous", "admission=static"]),
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


# ---- ranges (issue 39, item 3): every numeric setting with a natural range is checked before the run --------

RANGES = [
    # the inputs: the health watch
    (["trainer.health.remedy=lr_scale", "trainer.health.lr_scale=-1"], ["trainer.health.lr_scale", "(0, 1]", "-1"]),
    (["trainer.health.zero_adv_group_frac=50"], ["trainer.health.zero_adv_group_frac", "(0, 1]", "50"]),
    (["trainer.health.clip_scale=0"], ["trainer.health.clip_scale", "(0, 1]"]),
    (["trainer.health.max_length_frac=0"], ["trainer.health.max_length_frac"]),
    (["trainer.health.rollout_probs_diff_max=2"], ["trainer.health.rollout_probs_diff_max"]),
    (["trainer.health.entropy_min=-1"], ["trainer.health.entropy_min", ">= 0"]),
    (["trainer.health.ppo_kl_max=0"], ["trainer.health.ppo_kl_max", "> 0"]),
    (["trainer.health.grad_norm_zscore=-3"], ["trainer.health.grad_norm_zscore"]),
    # the input: multi-turn limits
    (["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=-5"],
     ["actor_rollout_ref.rollout.multi_turn.max_tool_response_length=-5", "null for no limit"]),
    (["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=0"],
     ["max_tool_response_length=0"]),
    # issue 34: environments, simulated users, turn rewards
    (["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.env_timeout_s=0"],
     ["actor_rollout_ref.rollout.multi_turn.env_timeout_s=0", "positive number of seconds"]),
    (["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.env_config_path=/no.yaml"],
     ["multi_turn.env_config_path=/no.yaml: no such file", "'envs:' list"]),
    (["algorithm.turn_rewards=token"], ["algorithm.turn_rewards=token", "multi_turn.enable=false"]),
    (["algorithm.turn_gamma=2"], ["algorithm.turn_gamma"]),
    # issue 34: the agent endpoint
    (["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.endpoint.enable=true"], ["actor_rollout_ref.rollout.multi_turn.endpoint.agent_path", "run_episode("]),
    (["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.endpoint.enable=true", "actor_rollout_ref.rollout.multi_turn.endpoint.agent_path=/no_agent.py"],
     ["actor_rollout_ref.rollout.multi_turn.endpoint.agent_path='/no_agent.py': no such file"]),
    (["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.endpoint.enable=true", "actor_rollout_ref.rollout.multi_turn.endpoint.agent_path=/no_agent.py",
      "actor_rollout_ref.rollout.multi_turn.endpoint.max_concurrent_episodes=0"], ["actor_rollout_ref.rollout.multi_turn.endpoint.max_concurrent_episodes=0"]),
    (["actor_rollout_ref.rollout.multi_turn.endpoint.enable=true"], ["actor_rollout_ref.rollout.multi_turn.endpoint.enable=true", "multi_turn.enable=true"]),
    (["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.endpoint.enable=true", "actor_rollout_ref.rollout.multi_turn.endpoint.agent_path=/no_agent.py",
      "actor_rollout_ref.rollout.multi_turn.endpoint.episode_timeout_s=0"], ["actor_rollout_ref.rollout.multi_turn.endpoint.episode_timeout_s=0"]),
    # issue 37: the MoE load-balancing loss
    (["actor_rollout_ref.actor.router_aux_loss_coef=-0.1"], ["actor_rollout_ref.actor.router_aux_loss_coef", "-0.1"]),
    # reward: timeouts, retries, batch sizes (the remote scorer's whether or not .url is set)
    (["custom_reward_function.timeout_s=0"], ["custom_reward_function.timeout_s=0", "null for no limit"]),
    (["custom_reward_function.request_timeout_s=-1"], ["custom_reward_function.request_timeout_s"]),
    (["custom_reward_function.max_retries=-1"], ["custom_reward_function.max_retries=-1", ">= 0"]),
    (["custom_reward_function.batch_size=0"], ["custom_reward_function.batch_size=0", ">= 1"]),
    (["custom_reward_function.max_concurrency=0"], ["custom_reward_function.max_concurrency"]),
    (["reward_model.overlong_buffer.penalty_factor=-1"], ["reward_model.overlong_buffer.penalty_factor"]),
    (["reward_model.enable=true", "reward_model.style=generative", "reward_model.judge.score_min=5",
      "reward_model.judge.score_max=1"], ["reward_model.judge.score_min=5 must be < reward_model.judge.score_max=1"]),
    (["reward_model.enable=true", "reward_model.style=generative", "reward_model.judge.gpu_memory_utilization=0"],
     ["reward_model.judge.gpu_memory_utilization"]),
    # sampling
    (["actor_rollout_ref.rollout.top_p=0"], ["actor_rollout_ref.rollout.top_p", "(0, 1]"]),
    (["actor_rollout_ref.rollout.val_kwargs.top_p=1.5"], ["actor_rollout_ref.rollout.val_kwargs.top_p"]),
    (["actor_rollout_ref.rollout.top_k=-5"], ["actor_rollout_ref.rollout.top_k", "-1 (off)"]),
    (["actor_rollout_ref.rollout.val_kwargs.temperature=-1"], ["actor_rollout_ref.rollout.val_kwargs.temperature"]),
    (["actor_rollout_ref.rollout.kv_cache_memory_bytes=0"], ["actor_rollout_ref.rollout.kv_cache_memory_bytes"]),
    (["actor_rollout_ref.rollout.weight_bucket_mb=0"], ["actor_rollout_ref.rollout.weight_bucket_mb", "> 0 MiB"]),
    # the actor's and critic's losses, the optimizer
    (["actor_rollout_ref.actor.clip_ratio=0"], ["actor_rollout_ref.actor.clip_ratio", "> 0"]),
    (["actor_rollout_ref.actor.clip_ratio_high=-0.1"], ["actor_rollout_ref.actor.clip_ratio_high"]),
    (["actor_rollout_ref.actor.clip_ratio_c=1"], ["actor_rollout_ref.actor.clip_ratio_c", "> 1"]),
    (["actor_rollout_ref.actor.grad_clip=0"], ["actor_rollout_ref.actor.grad_clip"]),
    # issue 52: CISPO's weight bounds, SAPO's temperatures
    (["actor_rollout_ref.actor.policy_loss.cispo_clip_ratio_low=1.5"],
     ["actor_rollout_ref.actor.policy_loss.cispo_clip_ratio_low", "[0, 1]"]),
    (["actor_rollout_ref.actor.policy_loss.cispo_clip_ratio_high=0"],
     ["actor_rollout_ref.actor.policy_loss.cispo_clip_ratio_high", "> 0"]),
    (["actor_rollout_ref.actor.policy_loss.tau_pos=0"], ["actor_rollout_ref.actor.policy_loss.tau_pos", "> 0"]),
    (["actor_rollout_ref.actor.policy_loss.tau_neg=-1"], ["actor_rollout_ref.actor.policy_loss.tau_neg", "> 0"]),
    (["actor_rollout_ref.actor.kl_loss_coef=-1"], ["actor_rollout_ref.actor.kl_loss_coef"]),
    (["actor_rollout_ref.actor.optim.num_cycles=-1"], ["actor_rollout_ref.actor.optim.num_cycles"]),
    (["critic.cliprange_value=0"], ["critic.cliprange_value"]),
    (["critic.grad_clip=-1"], ["critic.grad_clip"]),
    # the algorithm
    (["algorithm.gamma=1.5"], ["algorithm.gamma", "[0, 1]"]),
    (["algorithm.adv_estimator=gdpo"], ["algorithm.adv_estimator=gdpo", "algorithm.reward_weights is null"]),
    (["algorithm.adv_estimator=grpo", "algorithm.reward_weights={correct: 1}"],
     ["algorithm.reward_weights is set but algorithm.adv_estimator=grpo"]),
    (["algorithm.adv_estimator=gdpo", "algorithm.reward_weights={correct: oops}"],
     ["algorithm.reward_weights.correct='oops'"]),
    (["algorithm.lam=-0.5"], ["algorithm.lam"]),
    (["algorithm.rollout_mask.token_low=2", "algorithm.rollout_mask.token_high=0.5"],
     ["algorithm.rollout_mask.token_low=2 must be < algorithm.rollout_mask.token_high=0.5"]),
    (["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=-1"], ["algorithm.kl_ctrl.kl_coef"]),
    (["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"],
     ["algorithm.kl_ctrl.horizon"]),
    # the run
    (["trainer.max_actor_ckpt_to_keep=-1"], ["trainer.max_actor_ckpt_to_keep", "null to keep all"]),
    (["trainer.critic_warmup=-1"], ["trainer.critic_warmup"]),
    (["trainer.log_val_generations=-1"], ["trainer.log_val_generations"]),
    (["ray_init.num_cpus=0"], ["ray_init.num_cpus"]),
    # the update path's keys (issue 33)
    (["actor_rollout_ref.actor.optim.kernel=fast"], ["actor_rollout_ref.actor.optim.kernel", "fast"]),
    (["critic.optim.kernel=fast"], ["critic.optim.kernel", "fast"]),
    (["actor_rollout_ref.model.logit_block_elements=0"], ["actor_rollout_ref.model.logit_block_elements"]),
]


@pytest.mark.parametrize("overrides,named", RANGES, ids=[" ".join(o) for o, _ in RANGES])
def test_a_setting_out_of_its_range_fails_in_preflight_naming_the_key(files, overrides, named):
    with pytest.raises(ConfigError) as err:
        preflight_check(make_config(files, *overrides))
    for word in named:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def test_an_entropy_floor_the_model_cannot_reach_is_refused(files, tmp_path):
    """The issue's trainer.health.entropy_min=100: above ln(vocab_size), the watch would fire at every step."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512, "vocab_size": 1000}))
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer_config.json").write_text("{}")
    for value in ("100", "6.91"):  # ln(1000) = 6.908
        with pytest.raises(ConfigError, match=r"trainer\.health\.entropy_min=.* ln\(1000\) = 6\.91"):
            preflight_check(make_config(files, f"actor_rollout_ref.model.path={model}",
                                        f"trainer.health.entropy_min={value}"))
    preflight_check(make_config(files, f"actor_rollout_ref.model.path={model}", "trainer.health.entropy_min=0.05"))


def test_nulls_and_edges_of_the_ranges_pass(files):
    preflight_check(make_config(
        files, "trainer.health.zero_adv_group_frac=1", "trainer.health.max_length_frac=0.5",
        "trainer.health.lr_scale=1", "trainer.health.clip_scale=0.1", "trainer.health.entropy_min=0",
        "trainer.health.grad_norm_zscore=null", "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=null", "custom_reward_function.timeout_s=null",
        "custom_reward_function.max_retries=0", "actor_rollout_ref.rollout.top_k=0", "algorithm.gamma=0",
        "actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.temperature=0",
        "actor_rollout_ref.rollout.weight_bucket_mb=null", "algorithm.rollout_mask.token_high=1.5"))


# ---- all errors of one command together (issue 39, item 3) -------------------------------------------------


def test_the_errors_of_one_command_come_together_numbered_each_naming_its_key(files):
    config = make_config(files, "trainer.health.remedy=lr_scale", "trainer.health.lr_scale=-1",
                         "trainer.health.zero_adv_group_frac=50", "trainer.health.clip_scale=0",
                         "actor_rollout_ref.rollout.multi_turn.enable=true",
                         "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=-5",
                         "data.max_prompt_length=0", "custom_reward_function.timeout_s=-1",
                         "actor_rollout_ref.actor.optim.lr=0")
    with pytest.raises(ConfigError) as err:
        preflight_check(config)
    lines = str(err.value).splitlines()
    keys = ["trainer.health.lr_scale", "trainer.health.zero_adv_group_frac", "trainer.health.clip_scale",
            "multi_turn.max_tool_response_length", "data.max_prompt_length", "custom_reward_function.timeout_s",
            "actor_rollout_ref.actor.optim.lr"]
    assert lines[0] == f"{len(keys)} problems in the configuration; fix each of them:", str(err.value)
    for number, line in enumerate(lines[1:], 1):
        assert line.startswith(f"  {number}. "), str(err.value)
    for key in keys:  # each on a line of its own, once
        assert sum(key in line for line in lines[1:]) == 1, (key, str(err.value))


def test_two_bad_values_are_named_in_one_error(files):
    with pytest.raises(ConfigError) as err:
        preflight_check(make_config(files, "trainer.health.entropy_min=-1", "algorithm.gamma=2"))
    assert "2 problems" in str(err.value)
    assert "trainer.health.entropy_min" in str(err.value) and "algorithm.gamma" in str(err.value)


def test_one_error_keeps_its_own_message_and_type(files):
    with pytest.raises(ConfigError) as err:
        preflight_check(make_config(files, "algorithm.gamma=2"))
    assert str(err.value) == "algorithm.gamma must be a fraction in [0, 1] (the discount per token), got 2"


def test_a_check_that_depends_on_a_failed_one_is_not_run(files):
    """A missing model folder: its tokenizer, context length and resume checks would read files that are not
    there; only the folder is named (with the other, independent errors)."""
    with pytest.raises(ConfigError) as err:
        preflight_check(make_config(files, "actor_rollout_ref.model.path=/nonexistent/model", "algorithm.gamma=2",
                                    "data.train_files=/nonexistent/train.parquet"))
    message = str(err.value)
    assert message.startswith("3 problems"), message
    for text in ("actor_rollout_ref.model.path=/nonexistent/model", "algorithm.gamma", "/nonexistent/train.parquet"):
        assert text in message


def test_the_supervised_stages_report_their_errors_together():
    from hflow.trainer.config import SCHEMAS, validate_config
    from hflow.trainer.supervised_trainer import check_stage_config, fill_builtin_stage_defaults

    overrides = ["optim.lr=-1", "data.max_length=0", "optim.grad_clip=0"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = validate_config(compose(config_name="sft_trainer", overrides=overrides), SCHEMAS["sft_trainer"])
    fill_builtin_stage_defaults(config, "sft", frozenset(o.split("=")[0] for o in overrides))
    with pytest.raises(ConfigError) as err:
        check_stage_config(config, "sft")
    message = str(err.value)
    assert message.startswith("3 problems"), message
    for key in ("optim.lr", "data.max_length", "optim.grad_clip"):
        assert key in message, (key, message)
