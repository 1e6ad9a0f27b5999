"""Reject impossible configurations before Ray starts or any model loads.

Each check raises `ConfigError` naming the keys to change. The rules that the workers also apply (batch
sizes, tensor parallelism, known names) are the functions of `hflow.config_schema`, applied here with the
world size the trainer will use, so the two can never disagree. The config has passed
`hflow.config_schema.validate_config`: every key is present and of its type.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hflow.algorithms import core_algos
from hflow.config_schema import (
    KL_TYPES,
    LOSS_AGG_MODES,
    ROLLOUT_NAMES,
    ConfigError,
    check_choice,
    check_micro_batch,
    check_mini_batch,
    check_offload,
    check_optim,
    check_positive,
    check_placement,
    check_tensor_parallel,
    check_train_batch,
    per_rank_mini_batch,
)
from hflow.reward.dynamic_sampling import check_dapo_config
from hflow.trainer.ppo.health import check_health_config
from hflow.utils.tracking import check_backends
from hflow.workers.config import (
    check_ema,
    check_lora,
    check_model_path,
    check_ptx,
    check_tokenizer_path,
    check_value_head,
    resolve_gpu_memory_utilization,
)


def _files(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def check_data_files(value, key: str) -> None:
    """`key` names one parquet file or a list of them, each a file that exists."""
    files = _files(value)
    if not files:
        raise ConfigError(f"{key} is empty; give one parquet file or a list of them")
    for path in files:
        if Path(str(path)).expanduser().is_dir():
            raise ConfigError(f"{key}: {path} is a folder; give the parquet files in it "
                              f"(a list: {key}=[a.parquet,b.parquet])")
        if not Path(str(path)).expanduser().is_file():
            raise ConfigError(f"{key}: file {path} does not exist")


def check_node_resources(config: DictConfig) -> None:
    """The workers fit the node the driver runs on (one node, no cluster joined): trainer.n_gpus_per_node
    workers of trainer.cpus_per_worker CPUs each, and on a GPU node one GPU each. Checked before the batch
    rules, whose messages would otherwise blame a batch size for a node that is too small."""
    trainer = config.trainer
    cpus = int(trainer.cpus_per_worker)
    if cpus < 1:
        raise ConfigError(f"trainer.cpus_per_worker must be >= 1, got {cpus}")
    threads = trainer.threads_per_worker
    if threads is not None and int(threads) < 1:
        raise ConfigError(f"trainer.threads_per_worker must be >= 1 or null, got {threads}")
    available = config.ray_init.num_cpus or os.cpu_count()
    joins_cluster = config.ray_init.address or os.environ.get("RAY_ADDRESS")
    if (trainer.backend == "ray" and int(trainer.nnodes) == 1 and not joins_cluster
            and cpus * int(trainer.n_gpus_per_node) > available):
        raise ConfigError(
            f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} workers x trainer.cpus_per_worker={cpus} CPUs "
            f"need {cpus * int(trainer.n_gpus_per_node)} CPUs but this node has {available} "
            "(ray_init.num_cpus or the machine's cores); lower one of them")
    from hflow.utils import device

    if device.is_cuda() and int(trainer.nnodes) == 1 and not joins_cluster:  # the driver's node is the one node
        import torch

        if int(trainer.n_gpus_per_node) > torch.cuda.device_count():
            raise ConfigError(f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} but this node has "
                              f"{torch.cuda.device_count()} GPUs")


def check_resume(trainer: DictConfig) -> None:
    """`trainer.resume_mode`, and with `resume_path` a checkpoint folder that exists."""
    check_choice(trainer.resume_mode, ("auto", "resume_path", "disable"), "trainer.resume_mode")
    if trainer.resume_mode != "resume_path":
        return
    path = trainer.resume_from_path
    folder = Path(str(path)).expanduser()
    if path is None:
        problem = "it is not set"
    elif not folder.is_dir():
        problem = "no such folder"
    elif not folder.name.startswith("global_step_"):
        problem = "not a global_step_N folder"
    elif not (folder / "data" / "state.pt").is_file():
        problem = "an incomplete checkpoint: it has no data/state.pt"
    else:
        return
    raise ConfigError(f"trainer.resume_mode=resume_path needs trainer.resume_from_path to be a global_step_N "
                      f"checkpoint folder, got {path} ({problem}); give one under trainer.default_local_dir, or set "
                      "trainer.resume_mode=auto")


def preflight_check(config: DictConfig) -> None:
    """All checks that need nothing but the config and the file system (fast: no model is loaded)."""
    data, arr, algo, trainer = config.data, config.actor_rollout_ref, config.algorithm, config.trainer
    actor, rollout = arr.actor, arr.rollout
    world = int(trainer.n_gpus_per_node) * int(trainer.nnodes)
    if world < 1:
        raise ConfigError(f"trainer.n_gpus_per_node x trainer.nnodes must be >= 1, got {world}")
    backend = trainer.backend
    check_choice(backend, ("ray", "local"), "trainer.backend")
    if backend == "local" and world != 1:
        raise ConfigError(
            f"trainer.backend=local runs one rank in this process, but trainer.n_gpus_per_node x trainer.nnodes "
            f"= {world}; set trainer.n_gpus_per_node=1 trainer.nnodes=1, or use trainer.backend=ray")
    n = int(rollout.n)
    if n < 1:
        raise ConfigError(f"actor_rollout_ref.rollout.n must be >= 1, got {n}")
    check_sizes(config)
    from hflow.utils.dataset.rl_dataset import TRUNCATION_MODES

    check_choice(data.truncation, TRUNCATION_MODES, "data.truncation")
    check_optim(actor.optim, "actor_rollout_ref.actor.optim")
    for key, fsdp_config in (("actor_rollout_ref.actor.fsdp_config", actor.fsdp_config),
                             ("actor_rollout_ref.ref.fsdp_config", arr.ref.fsdp_config)):
        check_offload(fsdp_config, key)
    resolve_gpu_memory_utilization(rollout.gpu_memory_utilization, False,
                                   "actor_rollout_ref.rollout.gpu_memory_utilization")

    # files
    check_data_files(data.train_files, "data.train_files")
    check_data_files(data.val_files, "data.val_files")
    check_model_path(arr.model.path, "actor_rollout_ref.model.path")
    check_tokenizer_path(arr.model, "actor_rollout_ref.model")
    check_lora(arr, "actor_rollout_ref")
    check_health_config(config)
    if config.custom_reward_function.path is not None and not Path(
            str(config.custom_reward_function.path)).expanduser().is_file():
        raise ConfigError(f"custom_reward_function.path: file {config.custom_reward_function.path} does not exist")
    # Import the reward file now, so that a syntax error, a wrong .name or a signature that the trainer
    # cannot call stops the run before the tokenizer and data load (the trainer reuses the loaded file).
    from hflow.reward.managers import get_reward_manager_cls
    from hflow.reward.managers.loader import (
        check_reward_fn_signature,
        get_custom_reward_fn,
        get_remote_scorer,
    )

    reward_fn = get_custom_reward_fn(config)
    get_reward_manager_cls(config.reward_model.reward_manager)  # a manager of the user's registers in that file
    if config.custom_reward_function.url is not None:
        try:
            get_remote_scorer(config)  # the URL and the client's settings
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if config.custom_reward_function.path is not None:
            raise ConfigError("custom_reward_function: set .path (a local function) or .url (a remote scorer), "
                              "not both")
    check_reward_fn_signature(reward_fn, config.reward_model.reward_manager)

    # algorithm names
    known = [e.value for e in core_algos.AdvantageEstimator]
    if algo.adv_estimator not in known:
        raise ConfigError(f"algorithm.adv_estimator={algo.adv_estimator!r} is unknown; choose from {known}")
    check_choice(actor.loss_agg_mode, LOSS_AGG_MODES, "actor_rollout_ref.actor.loss_agg_mode")
    try:
        core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
    except (KeyError, ValueError) as err:
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.loss_mode: {err}") from None
    if actor.use_kl_loss:
        check_choice(actor.kl_loss_type.removesuffix("+"), KL_TYPES, "actor_rollout_ref.actor.kl_loss_type")
    if algo.use_kl_in_reward:
        check_choice(algo.kl_penalty.removesuffix("+"), KL_TYPES, "algorithm.kl_penalty")
        check_choice(algo.kl_ctrl.type, ("fixed", "adaptive"), "algorithm.kl_ctrl.type")
    check_choice(rollout.name, ROLLOUT_NAMES, "actor_rollout_ref.rollout.name")
    if algo.reuse_update_log_probs:
        if algo.use_rollout_log_probs:
            raise ConfigError("algorithm.reuse_update_log_probs and algorithm.use_rollout_log_probs both replace the "
                              "old log-prob pass; set only one of them")
        if (int(actor.ppo_epochs) != 1 or int(actor.ppo_mini_batch_size) != int(config.data.train_batch_size)
                or algo.use_kl_in_reward):
            raise ConfigError(
                "algorithm.reuse_update_log_probs=true needs an on-policy update: actor_rollout_ref.actor.ppo_epochs=1, "
                "actor_rollout_ref.actor.ppo_mini_batch_size equal to data.train_batch_size "
                f"(got {actor.ppo_epochs}, {actor.ppo_mini_batch_size}, {config.data.train_batch_size}) and "
                "algorithm.use_kl_in_reward=false")
    if int(algo.rollout_check_freq) < 0:
        raise ConfigError(f"algorithm.rollout_check_freq={algo.rollout_check_freq}: give N >= 1 (the separate old-log-prob "
                          "pass every N steps when the update reuses its own) or 0 (never)")
    if algo.use_rollout_log_probs and not rollout.calculate_log_probs:
        raise ConfigError("algorithm.use_rollout_log_probs=true needs actor_rollout_ref.rollout.calculate_log_probs=true")
    check_rollout_is(algo, rollout)
    check_multi_turn(rollout.multi_turn)
    if algo.adv_estimator == "gae" and config.critic.model.path is None:
        raise ConfigError("algorithm.adv_estimator=gae trains a critic: set critic.model.path "
                          "(by default it is the actor's model)")
    if algo.adv_estimator == "gae":
        check_value_head(config.critic.model, "critic.model")
        check_optim(config.critic.optim, "critic.optim")
        check_offload(config.critic.model.fsdp_config, "critic.model.fsdp_config")
    check_rlhf_actor_details(config)
    if algo.adv_estimator in ("grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus_baseline") and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator} compares samples of the same prompt: set "
            f"actor_rollout_ref.rollout.n >= 2 (it is {n})")

    # placement: which ranks train and which generate
    batch = int(data.train_batch_size)
    tp = int(rollout.tensor_model_parallel_size)
    world, rollout_world = check_placement(trainer, rollout.name, tp, batch, n)
    check_node_resources(config)
    check_asynchrony(config)

    # batch sizes (global prompts -> per-rank sequences)
    check_train_batch(batch, n, world)
    check_mini_batch(actor.ppo_mini_batch_size, batch, "actor_rollout_ref.actor")
    per_rank = per_rank_mini_batch(actor.ppo_mini_batch_size, n, world, "actor_rollout_ref.actor",
                                   "actor_rollout_ref.rollout.n")
    check_micro_batch(per_rank, actor.ppo_micro_batch_size_per_gpu, "actor_rollout_ref.actor",
                      "ppo_micro_batch_size_per_gpu", actor.use_dynamic_bsz)
    if algo.adv_estimator == "gae":
        critic = config.critic
        check_mini_batch(critic.ppo_mini_batch_size, batch, "critic")
        per_rank = per_rank_mini_batch(critic.ppo_mini_batch_size, n, world, "critic", "critic.rollout_n")
        check_micro_batch(per_rank, critic.ppo_micro_batch_size_per_gpu, "critic", "ppo_micro_batch_size_per_gpu",
                          critic.use_dynamic_bsz)
    check_tensor_parallel(tp, rollout_world)

    # lengths against the model's context
    model_config = json.loads((Path(str(arr.model.path)).expanduser() / "config.json").read_text())
    max_positions = model_config.get("max_position_embeddings")
    total = int(data.max_prompt_length) + int(data.max_response_length)
    if max_positions and not model_config.get("rope_scaling") and total > max_positions:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's "
            f"max_position_embeddings ({max_positions}); shorten them")
    if rollout.val_kwargs.do_sample and float(rollout.val_kwargs.temperature) <= 0:
        raise ConfigError("actor_rollout_ref.rollout.val_kwargs.do_sample=true needs val_kwargs.temperature > 0")
    if float(rollout.temperature) <= 0 and rollout.do_sample:
        raise ConfigError("actor_rollout_ref.rollout.temperature must be > 0 for sampling "
                          "(set rollout.do_sample=false for greedy)")

    # trainer
    try:
        check_backends(trainer.logger)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_resume(trainer)
    if trainer.total_training_steps is None and int(trainer.total_epochs) < 1:
        raise ConfigError("set trainer.total_epochs >= 1 or trainer.total_training_steps")
    if config.reward_model.enable:
        check_model_path(config.reward_model.model.path, "reward_model.model.path")
        from hflow.reward.judge import check_judge_config

        check_judge_config(config.reward_model)
    check_reward_shaping(config)
    check_dapo_config(config)  # algorithm.filter_groups, reward_model.overlong_buffer
    check_choice(config.custom_reward_function.on_error, ("raise", "zero"), "custom_reward_function.on_error")
    check_reward_sources(config)
    if config.trainer.reward_audit:  # score gaming responses with the run's reward; refuse to train on a hole
        if not 0 <= float(config.trainer.reward_audit_max_accept) <= 1:
            raise ConfigError(f"trainer.reward_audit_max_accept must be in [0, 1], got "
                              f"{config.trainer.reward_audit_max_accept}")
        from hflow.reward.audit import check_reward_before_training

        check_reward_before_training(config)
    check_memory(config)


def check_memory(config: DictConfig) -> None:
    """`trainer.memory_plan`: the plan of peak device memory per phase (`hflow.cli.memory_plan`), last, on a
    configuration every other check has passed: `summary` prints one line, `enforce` refuses a plan that
    does not fit, naming the phase and the keys that make it fit."""
    mode = config.trainer.memory_plan
    check_choice(mode, ("off", "summary", "enforce"), "trainer.memory_plan")
    if config.trainer.device_memory_gb is not None and not float(config.trainer.device_memory_gb) > 0:
        raise ConfigError(f"trainer.device_memory_gb must be > 0 (GiB of one device) or null, "
                          f"got {config.trainer.device_memory_gb}")
    if mode != "off":
        from hflow.cli.memory_plan import check_memory_plan

        check_memory_plan(config, mode)


def check_sizes(config: DictConfig) -> None:
    """Lengths, counts and batch sizes that must be positive. Unchecked, a 0 or a negative value fails late
    and far from its key: in a worker after Ray started, as a division by zero, or inside a library."""
    keys = ["data.max_prompt_length", "data.max_response_length", "actor_rollout_ref.actor.ppo_epochs",
            "actor_rollout_ref.rollout.val_kwargs.n", "actor_rollout_ref.rollout.prompt_length",
            "actor_rollout_ref.rollout.response_length", "actor_rollout_ref.rollout.max_num_batched_tokens",
            "actor_rollout_ref.rollout.max_num_seqs"]
    # For these null, and 0 as well, mean "all" or "derived"; only a negative value is wrong.
    for key in ("data.val_batch_size", "actor_rollout_ref.rollout.micro_batch_size",
                "actor_rollout_ref.rollout.max_model_len", "trainer.total_training_steps"):
        value = OmegaConf.select(config, key)
        if value is not None and int(value) < 0:
            raise ConfigError(f"{key} must not be negative (0 or null: see its comment in the config), got {value}")
    # Where batches are cut by tokens the token budgets count, else the micro-batch sizes (the actor's and
    # the critic's training micro-batches are checked with the mini-batches).
    for section, dynamic, by_tokens, by_count in (
            ("actor_rollout_ref.actor", "use_dynamic_bsz", ["ppo_max_token_len_per_gpu"], []),
            ("actor_rollout_ref.rollout", "log_prob_use_dynamic_bsz", ["log_prob_max_token_len_per_gpu"],
             ["log_prob_micro_batch_size_per_gpu"]),
            ("actor_rollout_ref.ref", "log_prob_use_dynamic_bsz", ["log_prob_max_token_len_per_gpu"],
             ["log_prob_micro_batch_size_per_gpu"]),
            ("critic", "use_dynamic_bsz", ["ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu"],
             ["forward_micro_batch_size_per_gpu"])):
        if section == "critic" and config.algorithm.adv_estimator != "gae":
            continue  # no critic
        names = by_tokens if OmegaConf.select(config, f"{section}.{dynamic}") else by_count
        keys += [f"{section}.{name}" for name in names]
    if config.algorithm.adv_estimator == "gae":
        keys.append("critic.ppo_epochs")
    if config.reward_model.enable:
        keys.append("reward_model.micro_batch_size_per_gpu")
        if config.reward_model.max_length is not None:
            keys.append("reward_model.max_length")
    for key in keys:
        check_positive(OmegaConf.select(config, key), key)
    if int(config.data.dataloader_num_workers) < 0:
        raise ConfigError(f"data.dataloader_num_workers must be >= 0 (0 = load in the driver process), "
                          f"got {config.data.dataloader_num_workers}")


def check_reward_shaping(config: DictConfig) -> None:
    """`algorithm.reward_clip`, `.stop_token` (one token of the policy tokenizer, which is loaded: no
    model), `.missing_stop_penalty` and `reward_model.normalize`."""
    algo, normalize = config.algorithm, config.reward_model.normalize
    if algo.reward_clip is not None and not float(algo.reward_clip) > 0:
        raise ConfigError(f"algorithm.reward_clip must be a positive number (or null: no clipping), got {algo.reward_clip}")
    if algo.missing_stop_penalty is not None and algo.stop_token is None:
        raise ConfigError("algorithm.missing_stop_penalty scores the responses without algorithm.stop_token, which is "
                          "null; set algorithm.stop_token too, or algorithm.missing_stop_penalty=null")
    if algo.stop_token is not None:
        from transformers import AutoTokenizer

        from hflow.reward.shaping import resolve_stop_token_id

        model = config.actor_rollout_ref.model
        path = str(model.tokenizer_path or model.path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=bool(model.trust_remote_code))
        except (OSError, ValueError) as err:
            raise ConfigError(f"algorithm.stop_token is checked against the policy tokenizer, which does not load "
                              f"from {path}: {err}") from None
        resolve_stop_token_id(tokenizer, algo.stop_token)
    if normalize.enable:
        if not config.reward_model.enable:
            raise ConfigError("reward_model.normalize.enable=true normalises the reward model's scores, but "
                              "reward_model.enable=false; enable the reward model or set reward_model.normalize.enable=false")
        if int(normalize.num_prompts) < 2:
            raise ConfigError(f"reward_model.normalize.num_prompts must be >= 2 (a std needs two samples), "
                              f"got {normalize.num_prompts}")


def check_rlhf_actor_details(config: DictConfig) -> None:
    """PPO-ptx (`actor.ptx`: sizes, and with coef > 0 the text files: present, with the text column, not
    empty; only their footers are read) and the actor's EMA (`actor.ema`)."""
    from hflow.utils.dataset.ptx_dataset import check_ptx_files
    from hflow.utils.errors import DataError

    actor = config.actor_rollout_ref.actor
    check_ptx(actor.ptx, "actor_rollout_ref.actor.ptx")
    check_ema(actor.ema, "actor_rollout_ref.actor.ema")
    if float(actor.ptx.coef) > 0:
        try:
            check_ptx_files(actor.ptx.files, actor.ptx.text_key)
        except DataError as err:
            raise ConfigError(str(err)) from None


def check_reward_sources(config: DictConfig) -> None:
    """Without a custom reward function or remote scorer, every data source in the data needs a built-in scorer."""
    if config.custom_reward_function.path is not None or config.custom_reward_function.url is not None:
        return
    from hflow.utils.dataset.rl_dataset import read_parquet, read_parquet_schema
    from hflow.reward.score import SCORERS

    key = config.data.reward_fn_key
    for files_key in ("data.train_files", "data.val_files"):
        for path in _files(OmegaConf.select(config, files_key)):
            path = Path(str(path)).expanduser()
            if key not in read_parquet_schema(path, files_key).names:
                raise ConfigError(f"{files_key}: {path} has no column {key!r} (data.reward_fn_key)")
            table = read_parquet(path, files_key, columns=[key])
            unknown = sorted(set(table.column(key).to_pylist()) - set(SCORERS))
            if unknown:
                raise ConfigError(
                    f"{files_key}: {path} has data_source {unknown[0]!r}, which has no built-in scorer "
                    f"(known: {sorted(SCORERS)}); set custom_reward_function.path (and .name) to your scoring function")


def check_rollout_is(algo: DictConfig, rollout: DictConfig) -> None:
    """algorithm.rollout_is weighs pi_old (recomputed by the actor) against the sampler's log-probs:
    both must exist and differ in origin."""
    level = algo.get("rollout_is")
    if level is None:
        return
    check_choice(level, [e.value for e in core_algos.RolloutISLevel], "algorithm.rollout_is")
    if float(algo.rollout_is_threshold) <= 0:
        raise ConfigError(
            f"algorithm.rollout_is_threshold must be > 0 (>= 1 is sensible), got {algo.rollout_is_threshold}")
    if not rollout.calculate_log_probs:
        raise ConfigError("algorithm.rollout_is needs the sampler's log-probs: set "
                          "actor_rollout_ref.rollout.calculate_log_probs=true")
    if algo.use_rollout_log_probs:
        raise ConfigError("algorithm.rollout_is with algorithm.use_rollout_log_probs=true: the old log-probs are then "
                          "the sampler's, so there is nothing to correct; set one of them off")
    if algo.reuse_update_log_probs:
        raise ConfigError("algorithm.rollout_is needs old log-probs recomputed by the actor, which "
                          "algorithm.reuse_update_log_probs=true skips; set one of them off")


def check_multi_turn(multi_turn: DictConfig) -> None:
    """`actor_rollout_ref.rollout.multi_turn`: limits in range, a known call format, and tools that load
    (their YAML, classes and function files are read now, before any model)."""
    if not multi_turn.enable:
        return
    from hflow.agent.chat import TRUNCATE_SIDES
    from hflow.agent.parsers import get_parser
    from hflow.workers.rollout.multi_turn import load_rollout_tools

    prefix = "actor_rollout_ref.rollout.multi_turn"
    for key in ("max_assistant_turns", "max_user_turns"):
        value = multi_turn[key]
        if value is not None and int(value) < 1:
            raise ConfigError(f"{prefix}.{key}={value}; give a number >= 1, or null for no limit")
    for key in ("max_parallel_calls", "max_concurrent_tools"):
        if int(multi_turn[key]) < 1:
            raise ConfigError(f"{prefix}.{key}={multi_turn[key]}; it must be >= 1")
    if not float(multi_turn.tool_timeout_s) > 0:
        raise ConfigError(f"{prefix}.tool_timeout_s={multi_turn.tool_timeout_s}; give a positive number of seconds")
    check_choice(multi_turn.tool_response_truncate_side, TRUNCATE_SIDES, f"{prefix}.tool_response_truncate_side")
    try:
        get_parser(str(multi_turn.format))
    except ValueError as err:
        raise ConfigError(f"{prefix}.format: {err}") from None
    if multi_turn.tool_config_path is not None and not Path(str(multi_turn.tool_config_path)).expanduser().is_file():
        raise ConfigError(f"{prefix}.tool_config_path={multi_turn.tool_config_path}: no such file; point it at a "
                          "YAML with a 'tools:' list, or leave it null for the built-in calculator")
    load_rollout_tools(multi_turn)  # ConfigError naming the file, the tool and the key


def check_asynchrony(config: DictConfig) -> None:
    """`trainer.async_steps` and `rollout.partial_rollout`: what training on older rollouts needs."""
    trainer, algo, rollout = config.trainer, config.algorithm, config.actor_rollout_ref.rollout
    k = int(trainer.async_steps)
    if k and algo.adv_estimator == "remax":
        raise ConfigError("algorithm.adv_estimator=remax generates its greedy baseline beside the sampled batch, "
                          f"with the same weights; it does not work with trainer.async_steps={k}")
    if k and (algo.reuse_update_log_probs or algo.use_rollout_log_probs):
        raise ConfigError(
            f"trainer.async_steps={k} trains on rollouts sampled up to {k} updates earlier, so the old log-probs must "
            "be recomputed by the actor: set algorithm.reuse_update_log_probs=false and algorithm.use_rollout_log_probs=false")
    if k > 1 and not (rollout.calculate_log_probs and algo.rollout_is):
        # Decoupled PPO: the clip is taken against the recomputed (proximal) policy, and the sampler's own
        # log-probs weight each token by pi_proximal / pi_behaviour; without them the bias grows with k.
        raise ConfigError(
            f"trainer.async_steps={k} trains on rollouts sampled by policies up to {k} updates old, which needs "
            "their sampler log-probs to correct for it (decoupled PPO): set actor_rollout_ref.rollout.calculate_log_probs"
            "=true and algorithm.rollout_is=token (or sequence), or use trainer.async_steps=1")
    if rollout.partial_rollout and not k:
        raise ConfigError("actor_rollout_ref.rollout.partial_rollout=true continues generations in flight with new "
                          "weights, which only arrive during generation with trainer.placement=split and "
                          "trainer.async_steps >= 1")
