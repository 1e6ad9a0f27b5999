"""Reject impossible configurations before Ray starts or any model loads.

`preflight_check` is the list: each section's own check (beside the section's dataclass, in the module
that owns the section), then the rules that span sections, which live here. Each check raises
`ConfigError` naming the keys to change. The rules that the workers apply again with their real size
(batch sizes, tensor parallelism, known names) are the same functions, applied here with the world size
the trainer will use, so the two can never disagree. The config has passed `validate_config`: every key
is present and of its type.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hflow.agent.config import check_endpoint_port, check_multi_turn
from hflow.algorithms import core_algos
from hflow.algorithms.config import (
    GROUP_ESTIMATORS,
    check_adv_estimator,
    check_discount,
    check_distill_coefs,
    check_kl_in_reward,
    check_old_log_probs,
    check_reward_clip,
    check_reward_weights,
    check_turn_rewards,
    check_rollout_mask,
    rollout_mask_on,
)
from hflow.config_schema import ConfigError, ConfigErrors, check_choice, check_positive
from hflow.reward.config import (
    check_custom_reward_on_error,
    check_custom_reward_path,
    check_custom_reward_settings,
    check_reward_model_settings,
    check_reward_normalize,
)
from hflow.trainer.config import (
    check_memory_plan_keys,
    check_placement,
    check_ray_init,
    check_reward_audit,
    check_run,
    check_world,
    placement_pools,
)
from hflow.reward.dynamic_sampling import check_dapo_config
from hflow.reward.probe import probe_reward
from hflow.trainer.checkpoints import StepCheckpoints
from hflow.trainer.code_isolation import check_code_isolation
from hflow.trainer.ppo.health import check_health_config
from hflow.trainer.resume import check_resume_origin
from hflow.utils.dataset.config import check_data, data_files
from hflow.utils.vision import has_vision_tower
from hflow.workers.moe import check_moe_settings
from hflow.workers.config import (
    check_actor_losses,
    check_actor_ranges,
    check_model_kernels,
    check_ema,
    check_kernel_options,
    check_lora,
    check_model_path,
    check_offload,
    check_optim,
    check_ptx,
    check_tokenizer_path,
    check_train_batch,
    check_update_batches,
)
from hflow.workers.critic.config import check_critic, check_critic_batches
from hflow.workers.teacher.config import check_teacher, check_teacher_vocab, uses_teacher
from hflow.workers.teacher.privileged import check_teacher_data
from hflow.workers.rollout.config import (
    check_admission,
    check_endpoint_rollout,
    check_rollout_name,
    check_sampling,
    check_tensor_parallel,
    check_weight_bucket,
    resolve_gpu_memory_utilization,
)


def preflight_check(config: DictConfig) -> None:
    """All checks that need nothing but the config and the file system (fast: no model is loaded).

    The checks of the settings alone run each on its own and report their errors together, as one
    `ConfigError` with a numbered line per error (`ConfigErrors`); a check that needs an earlier one to
    have passed (a file that must exist before it is read, the ranks before the batch sizes that split
    over them) runs only when it did. Then, on a configuration without errors, the checks that call or
    try something (the sandbox, the reward, the audit, the memory plan), one after the other."""
    data, arr, algo, trainer = config.data, config.actor_rollout_ref, config.algorithm, config.trainer
    actor, rollout = arr.actor, arr.rollout
    gae = algo.adv_estimator == "gae"  # a critic is trained
    errors = ConfigErrors()
    run = errors.run

    world_ok = run(check_world, trainer)
    n_ok = run(check_rollout_n, rollout)
    n = int(rollout.n)
    sizes_ok = run(check_sizes, config)

    # each section on its own
    data_ok = run(check_data, data)
    run(check_optim, actor.optim, "actor_rollout_ref.actor.optim")
    run(check_offload, actor.fsdp_config, "actor_rollout_ref.actor.fsdp_config")
    run(check_offload, arr.ref.fsdp_config, "actor_rollout_ref.ref.fsdp_config")
    run(resolve_gpu_memory_utilization, rollout.gpu_memory_utilization, False,
        "actor_rollout_ref.rollout.gpu_memory_utilization")
    model_ok = run(check_model_path, arr.model.path, "actor_rollout_ref.model.path")
    if model_ok:
        model_ok = run(check_tokenizer_path, arr.model, "actor_rollout_ref.model")
    run(check_lora, arr, "actor_rollout_ref")
    run(check_kernel_options, arr.model, "actor_rollout_ref.model")
    run(check_model_kernels, arr.model, "actor_rollout_ref.model")
    run(check_health_config, config)
    run(check_reward_function, config)
    run(check_custom_reward_settings, config.custom_reward_function)
    run(check_adv_estimator, algo)
    run(check_discount, algo)
    run(check_actor_losses, actor)
    run(check_actor_ranges, actor)
    run(check_kl_in_reward, algo)
    run(check_distill_coefs, algo)
    # on-policy distillation: a teacher exactly when a weight uses it, and with the student's vocabulary
    if run(check_teacher, config) and model_ok and uses_teacher(config):
        run(check_teacher_vocab, config)
        if data_ok:
            run(check_teacher_data, config)  # template fields and teachers' data sources, row by row
    run(check_rollout_name, rollout.name)
    run(check_admission, rollout)
    run(check_endpoint_rollout, rollout)
    run(check_old_log_probs, algo)
    run(check_reuse_is_on_policy, config)
    with errors.catch():
        if algo.use_rollout_log_probs and not rollout.calculate_log_probs:
            raise ConfigError("algorithm.use_rollout_log_probs=true needs "
                              "actor_rollout_ref.rollout.calculate_log_probs=true")
    run(check_rollout_is, algo, rollout)
    if rollout.multi_turn.enable and run(check_multi_turn, rollout.multi_turn):
        from hflow.workers.rollout.multi_turn import load_rollout_tools

        # the tools, environments and simulated users load now: ConfigError naming the file, the entry, the key
        run(load_rollout_tools, rollout.multi_turn)
        if rollout.multi_turn.env_config_path is not None:
            from hflow.agent.env import load_envs

            run(load_envs, rollout.multi_turn.env_config_path)
        if rollout.multi_turn.interaction_config_path is not None:
            from hflow.agent.interactions import load_interactions

            run(load_interactions, rollout.multi_turn.interaction_config_path)
    run(check_turn_rewards, algo)
    run(check_reward_weights, algo)
    with errors.catch():
        if algo.turn_rewards != "ignore" and not rollout.multi_turn.enable:
            raise ConfigError(f"algorithm.turn_rewards={algo.turn_rewards} trains on the turn rewards of multi-turn "
                              "episodes, but actor_rollout_ref.rollout.multi_turn.enable=false; enable it, or set "
                              "algorithm.turn_rewards=ignore")
    if gae:
        run(check_critic, config.critic)
        if not arr.model.use_liger:  # the critic's follows the policy's unless set on its own
            run(check_kernel_options, config.critic.model, "critic.model")
    run(check_rlhf_actor_details, config)
    with errors.catch():
        if n_ok and algo.adv_estimator in GROUP_ESTIMATORS and n < 2:
            raise ConfigError(
                f"algorithm.adv_estimator={algo.adv_estimator} compares samples of the same prompt: set "
                f"actor_rollout_ref.rollout.n >= 2 (it is {n})")
    run(check_ray_init, config.ray_init)

    # placement (which ranks train and which generate), then the batch sizes that split over them
    # (global prompts -> per-rank sequences): one chain, each link on the ones before it
    if world_ok and n_ok and sizes_ok:
        run(check_placement_and_batches, config)
    if int(trainer.async_steps) >= 0:  # a negative one: check_placement's error
        run(check_asynchrony, config)
    run(check_deterministic, config)

    if model_ok and sizes_ok:
        run(check_context_length, config)
    if model_ok:
        run(check_moe_settings, config)  # router replay / the load-balancing loss: an MoE model
    run(check_sampling, rollout)
    run(check_weight_bucket, rollout)

    # the run, the reward
    if run(check_run, trainer) and model_ok:
        run(check_resumed_models, config)
    if config.reward_model.enable:
        run(check_model_path, config.reward_model.model.path, "reward_model.model.path")
        from hflow.reward.judge import check_judge_config

        run(check_judge_config, config.reward_model, config)  # (and the process its engine would share)
    run(check_reward_model_settings, config.reward_model)
    if model_ok:
        run(check_reward_shaping, config)
    else:
        run(check_reward_clip, algo)
        run(check_reward_normalize, config.reward_model)
    if sizes_ok and n_ok:
        run(check_dapo_config, config)  # algorithm.filter_groups, reward_model.overlong_buffer
    run(check_custom_reward_on_error, config.custom_reward_function)
    if data_ok:
        run(check_reward_sources, config)
    if data_ok and model_ok:  # it reads the model's config.json, which the model check has read first
        run(check_image_rollouts, config)
    if trainer.reward_audit:
        run(check_reward_audit, trainer)
    run(check_memory_plan_keys, trainer)
    errors.raise_any()

    # on a configuration without errors: what calls or tries something, one after the other
    check_code_isolation(config)  # code tools / code rewards: the sandbox isolates, or the run stops here
    probe_reward(config)  # the reward scores a few validation rows in time, or the run stops here
    if config.teacher.url is not None:  # a dead server or another tokenizer stops the run here
        from transformers import AutoTokenizer

        from hflow.workers.teacher.remote import check_remote_teacher

        student = AutoTokenizer.from_pretrained(str(arr.model.tokenizer_path or arr.model.path),
                                                trust_remote_code=bool(arr.model.trust_remote_code))
        check_remote_teacher(config.teacher, student, int(config.teacher.topk) if algo.distill.jsd_coef > 0 else 0)
    if trainer.reward_audit:  # score gaming responses with the run's reward; refuse to train on a hole
        from hflow.reward.audit import check_reward_before_training

        check_reward_before_training(config)
    check_memory(config)


def check_rollout_n(rollout: DictConfig) -> None:
    n = int(rollout.n)
    if n < 1:
        raise ConfigError(f"actor_rollout_ref.rollout.n must be >= 1, got {n}")


def check_placement_and_batches(config: DictConfig) -> None:
    """`trainer.placement` and the node's resources, then the training batch, the actor's (and critic's)
    mini- and micro-batches, the tensor-parallel groups and the agent endpoint's port against the ranks the
    placement gives."""
    data, arr, trainer = config.data, config.actor_rollout_ref, config.trainer
    rollout, n = arr.rollout, int(arr.rollout.n)
    batch = int(data.train_batch_size)
    tp = int(rollout.tensor_model_parallel_size)
    world, rollout_world = check_placement(trainer, rollout.name, tp, batch, n)
    train_nodes, rollout_nodes = placement_pools(int(trainer.nnodes), int(trainer.n_gpus_per_node), trainer.placement,
                                                 int(trainer.rollout_n_gpus))
    check_endpoint_port(rollout.multi_turn, max(rollout_nodes or train_nodes))  # a fixed port: one rollout rank per node
    check_node_resources(config)
    check_train_batch(batch, n, world)
    check_update_batches(arr.actor, batch, n, world, "actor_rollout_ref.actor", "actor_rollout_ref.rollout.n")
    if config.algorithm.adv_estimator == "gae":
        check_critic_batches(config.critic, batch, n, world)
    check_tensor_parallel(tp, rollout_world)


# ==================================================================================================
# Rules that span sections
# ==================================================================================================


def check_resumed_models(config: DictConfig) -> None:
    """The checkpoint a run would resume comes from the models the run names (`hflow.trainer.resume`)."""
    trainer = config.trainer
    step_dir = StepCheckpoints(trainer.default_local_dir, trainer.resume_mode, trainer.resume_from_path).find()
    roles = [("actor", "actor_rollout_ref.model.path", config.actor_rollout_ref.model.path)]
    if config.algorithm.adv_estimator == "gae":
        roles.append(("critic", "critic.model.path", config.critic.model.path))
    for role, key, path in roles:
        line = check_resume_origin(step_dir, role, key, path)
        if line and role == "actor":
            print(line, flush=True)


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


def check_reward_function(config: DictConfig) -> None:
    """`custom_reward_function`: the file is imported now, so that a syntax error, a wrong .name or a
    signature that the trainer cannot call stops the run before the tokenizer and data load (the trainer
    reuses the loaded file); a reward manager of the user's registers in that file; with `.url` the remote
    scorer's settings."""
    custom = config.custom_reward_function
    check_custom_reward_path(custom)
    from hflow.reward.managers import get_reward_manager_cls
    from hflow.reward.managers.loader import (
        check_reward_fn_signature,
        get_custom_reward_fn,
        get_remote_scorer,
    )

    reward_fn = get_custom_reward_fn(config)
    get_reward_manager_cls(config.reward_model.reward_manager)
    if custom.url is not None:
        try:
            get_remote_scorer(config)  # the URL and the client's settings
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if custom.path is not None:
            raise ConfigError("custom_reward_function: set .path (a local function) or .url (a remote scorer), "
                              "not both")
    check_reward_fn_signature(reward_fn, config.reward_model.reward_manager)


def check_reuse_is_on_policy(config: DictConfig) -> None:
    """`algorithm.reuse_update_log_probs=true` is exact only for one on-policy update per step."""
    algo, actor = config.algorithm, config.actor_rollout_ref.actor
    if algo.reuse_update_log_probs and (
            int(actor.ppo_epochs) != 1 or int(actor.ppo_mini_batch_size) != int(config.data.train_batch_size)
            or algo.use_kl_in_reward):
        raise ConfigError(
            "algorithm.reuse_update_log_probs=true needs an on-policy update: actor_rollout_ref.actor.ppo_epochs=1, "
            "actor_rollout_ref.actor.ppo_mini_batch_size equal to data.train_batch_size "
            f"(got {actor.ppo_epochs}, {actor.ppo_mini_batch_size}, {config.data.train_batch_size}) and "
            "algorithm.use_kl_in_reward=false")
    if algo.reuse_update_log_probs and uses_teacher(config):
        raise ConfigError("a teacher (teacher.model.path) is compared with the student's log-probs before the update "
                          "(the distillation reward and its metrics), which algorithm.reuse_update_log_probs=true "
                          "does not compute; set it to null or false")


def check_context_length(config: DictConfig) -> None:
    """Prompt and response fit the model's context (read from its config.json)."""
    data = config.data
    model_config = json.loads((Path(str(config.actor_rollout_ref.model.path)).expanduser() / "config.json").read_text())
    max_positions = model_config.get("max_position_embeddings")
    total = int(data.max_prompt_length) + int(data.max_response_length)
    if max_positions and not model_config.get("rope_scaling") and total > max_positions:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's "
            f"max_position_embeddings ({max_positions}); shorten them")


def check_memory(config: DictConfig) -> None:
    """`trainer.memory_plan`: the plan of peak device memory per phase (`hflow.trainer.memory`), last, on a
    configuration every other check has passed: `summary` prints one line, `enforce` refuses a plan that
    does not fit, naming the phase and the keys that make it fit."""
    check_memory_plan_keys(config.trainer)
    mode = config.trainer.memory_plan
    if mode != "off":
        from hflow.trainer.memory.plan import check_memory_plan

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
    algo = config.algorithm
    check_reward_clip(algo)
    if config.reward_model.normalize.enable and config.data.streaming:  # its fit draws training prompts by index
        raise ConfigError("reward_model.normalize.enable=true fits on training prompts drawn at random, which "
                          "data.streaming=true does not hold; set data.streaming=false, or normalize.enable=false")
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
    check_reward_normalize(config.reward_model)


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
    from hflow.utils.dataset.sources import read_schema, read_table, split_for
    from hflow.reward.score import EPISODE_SCORERS, SCORERS

    known = {*SCORERS, *EPISODE_SCORERS}
    key = config.data.reward_fn_key
    for files_key in ("data.train_files", "data.val_files"):
        for path in data_files(OmegaConf.select(config, files_key)):
            path = Path(str(path)).expanduser()
            split = split_for(config.data, files_key)
            if key not in read_schema(path, files_key, *split).names:
                raise ConfigError(f"{files_key}: {path} has no column {key!r} (data.reward_fn_key)")
            table = read_table(path, files_key, [key], *split)
            sources = set(table.column(key).to_pylist())
            unknown = sorted(sources - known)
            if unknown:
                raise ConfigError(
                    f"{files_key}: {path} has data_source {unknown[0]!r}, which has no built-in scorer "
                    f"(known: {sorted(known)}); set custom_reward_function.path (and .name) to your scoring function")
            by_episode = sorted(sources & set(EPISODE_SCORERS))
            if by_episode and not config.actor_rollout_ref.rollout.multi_turn.enable:
                raise ConfigError(
                    f"{files_key}: {path} has data_source {by_episode[0]!r}, scored by its environment's verdict in a "
                    "multi-turn episode; set actor_rollout_ref.rollout.multi_turn.enable=true with its environment "
                    "(multi_turn.env_config_path), or data.builtin_task=vault for the built-in one")


def _torchvision_missing() -> str | None:
    """Why torchvision does not load here (None when it does): vLLM's Qwen2-VL model file imports it."""
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # absent, or a build for another torch ("operator torchvision::nms does not exist")
        return f"{type(err).__name__}: {err}"
    return None


def check_image_rollouts(config: DictConfig) -> None:
    """Prompts with images (a `data.image_key` column in the data files) are sampled by the HF rollout, single-
    and multi-turn, and by vLLM single-turn; vLLM's streaming paths (its multi-turn loop, continuous admission,
    generation interrupted by weight updates) do not hand the engine the images yet, and would sample blind.
    And vLLM cannot build a vision-language model where torchvision does not load (the CPU stack: no
    torchvision wheel matches its torch build); its engine would stop at start-up with a traceback."""
    rollout, prefix = config.actor_rollout_ref.rollout, "actor_rollout_ref.rollout"
    if rollout.name != "vllm":
        return
    model_path = str(config.actor_rollout_ref.model.path)
    if has_vision_tower(model_path):
        why = _torchvision_missing()
        if why is not None:
            raise ConfigError(
                f"{prefix}.name=vllm cannot sample from the vision-language model {model_path} here: vLLM's model "
                f"file for it imports torchvision, which does not load ({why}; no torchvision wheel matches the "
                f"CPU build of torch). Set {prefix}.name=hf: the HF rollout samples prompts with images on CPU "
                "(the built-in vision task uses it)")
    streaming = [key for key, on in ((f"{prefix}.multi_turn.enable=true", rollout.multi_turn.enable),
                                     (f"{prefix}.admission=continuous", rollout.admission == "continuous"),
                                     (f"{prefix}.partial_rollout=true", rollout.partial_rollout),
                                     (f"trainer.async_steps={config.trainer.async_steps}",
                                      int(config.trainer.async_steps) >= 2)) if on]
    if not streaming:
        return
    from hflow.utils.dataset.sources import read_schema, split_for

    image_key = config.data.image_key
    for key in ("data.train_files", "data.val_files"):
        for path in data_files(OmegaConf.select(config, key)):
            if image_key in read_schema(Path(str(path)).expanduser(), key, *split_for(config.data, key)).names:
                raise ConfigError(
                    f"{key}: {path} has images (column {image_key!r}, data.image_key), which vLLM's streaming "
                    f"rollouts do not take yet ({', '.join(streaming)}); sample them with "
                    f"{prefix}.name=hf (single- or multi-turn), or with vLLM single-turn (turn those keys off)")


def check_rollout_is(algo: DictConfig, rollout: DictConfig) -> None:
    """algorithm.rollout_is and algorithm.rollout_mask weigh pi_old (recomputed by the actor) against the
    sampler's log-probs: both must exist and differ in origin."""
    level, masking = algo.rollout_is, rollout_mask_on(algo)
    if level is None and not masking:
        return
    if level is not None:
        check_choice(level, [e.value for e in core_algos.RolloutISLevel], "algorithm.rollout_is")
        if float(algo.rollout_is_threshold) <= 0:
            raise ConfigError(
                f"algorithm.rollout_is_threshold must be > 0 (>= 1 is sensible), got {algo.rollout_is_threshold}")
    if masking:
        check_rollout_mask(algo)
    name = "algorithm.rollout_is" if level is not None else "algorithm.rollout_mask"
    if not rollout.calculate_log_probs:
        raise ConfigError(f"{name} needs the sampler's log-probs: set "
                          "actor_rollout_ref.rollout.calculate_log_probs=true")
    if algo.use_rollout_log_probs:
        raise ConfigError(f"{name} with algorithm.use_rollout_log_probs=true: the old log-probs are then "
                          "the sampler's, so there is nothing to correct; set one of them off")
    if algo.reuse_update_log_probs:
        raise ConfigError(f"{name} needs old log-probs recomputed by the actor, which "
                          "algorithm.reuse_update_log_probs=true skips; set one of them off")


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


def check_deterministic(config: DictConfig) -> None:
    """`trainer.deterministic=true`: the options whose result depends on timing, named together."""
    if not config.trainer.deterministic:
        return
    errors = ConfigErrors()
    with errors.catch():
        if config.actor_rollout_ref.rollout.partial_rollout:
            raise ConfigError("trainer.deterministic=true with actor_rollout_ref.rollout.partial_rollout=true: where an "
                              "update interrupts a generation depends on timing; set one of them false")
    with errors.catch():
        if config.actor_rollout_ref.rollout.admission == "continuous":
            raise ConfigError("trainer.deterministic=true with actor_rollout_ref.rollout.admission=continuous: which "
                              "engine samples a row (and so with which random stream) depends on which has room "
                              "first, that is on timing; use admission=static (a fixed shard per engine)")
    errors.raise_any()
