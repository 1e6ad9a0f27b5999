"""Train a policy with PPO / GRPO on one node:

    python -m hflow.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=train.parquet ...

With no data or model given, it trains the built-in small model on the built-in arithmetic task.
The configuration is checked before Ray starts or any model loads; every impossible combination is
reported with the keys to change.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from hflow import CONFIG_DIR
from hflow.config_schema import ConfigError, ConfigErrors, check_override_key
from hflow.sandbox import sandbox_env
from hflow.tasks.defaults import fill_builtin_defaults
from hflow.trainer.config import SCHEMAS, validate_config
from hflow.trainer.preflight import preflight_check
from hflow.utils.errors import UserError
from hflow.utils.logging_utils import install_library_filter, library_noise_env
from hflow.workers.rollout.vllm_env import VLLM_ENV
from hflow.workers.teacher.config import resolve_teacher


# Environment every worker process starts with: in-process vLLM engines on the model runner hflow chose
# (`VLLM_ENV`: the hybrid engine shares the worker's torch.distributed world), quiet tokenizers. Whatever
# depends on a worker's device is decided in the worker, which knows it; the driver may sit on a node
# without one.
WORKER_ENV = {
    **VLLM_ENV,
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARN",
    "NCCL_DEBUG": "WARN",
}


def run_ppo(config: DictConfig, user_keys: frozenset[str] = frozenset()) -> dict[str, float]:
    """Train; `user_keys` are the config keys given on the command line."""
    config = validate_config(config)  # unknown keys and wrong types stop here, naming the key
    fill_builtin_defaults(config, user_keys)
    resolve_teacher(config)  # teacher.source=self: the policy's own folder, its prompts' messages kept
    from hflow.trainer.memory.defaults import resolve_for_run

    resolve_for_run(config)  # null "by the device" keys (token budgets on GPU), printed; before the checks read them
    preflight_check(config)
    OmegaConf.resolve(config)
    trainer = build_trainer(config)  # tokenizer, datasets, reward functions: errors before any worker starts
    return train(trainer, config)


def train(trainer, config: DictConfig) -> dict[str, float]:
    """Start the backend, then the trainer's workers and its loop; the workers are stopped however it ends.
    Returns the last validation metrics."""
    start_backend(config)
    try:
        trainer.init_workers()
        val_metrics = trainer.fit()
    finally:
        trainer.shutdown()
    plot_learning_curve(config)
    return val_metrics


def start_backend(config: DictConfig) -> None:
    """Ray (started here, or joined at `ray_init.address`) for `trainer.backend=ray`; for `local`, the
    workers' environment in this process, and Ray is never imported."""
    env = {**WORKER_ENV, **library_noise_env(), **sandbox_env()}  # sandbox_env: the run's isolation decision
    if config.trainer.backend == "local":
        for key, value in env.items():
            os.environ.setdefault(key, value)
        return
    import ray

    if not ray.is_initialized():
        ray.init(
            address=config.ray_init.address,
            num_cpus=config.ray_init.num_cpus,
            include_dashboard=False,
            runtime_env={"env_vars": env},
        )


def build_trainer(config: DictConfig):
    from hflow.trainer.ppo.ray_trainer import RayPPOTrainer
    from hflow.utils.dataset import RLHFDataset, collate_fn, create_train_dataloader
    from hflow.reward.managers import load_reward_manager
    from hflow.utils.vision import load_processor

    tokenizer = load_tokenizer(config.actor_rollout_ref.model, "actor_rollout_ref.model")
    tools = None
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if multi_turn.enable:  # prompts describe the tools to templates that render them
        from hflow.agent.tool_config import tool_schemas
        from hflow.workers.rollout.multi_turn import load_rollout_tools

        tools = tool_schemas(load_rollout_tools(multi_turn))
    # a vision-language model's image processor (None for a text-only model: data with images is refused)
    model_cfg = config.actor_rollout_ref.model
    processor = load_processor(model_cfg.path, tokenizer, model_cfg.trust_remote_code)
    if config.data.streaming:  # read lazily, shuffled in a buffer; validation stays in memory
        from hflow.utils.dataset.streaming import StreamedPrompts, StreamingDataLoader

        train_dataset = StreamedPrompts(config.data.train_files, tokenizer, config.data, tools=tools,
                                        processor=processor)
        train_dataloader = StreamingDataLoader(train_dataset, config.data.train_batch_size, collate_fn)
    else:
        train_dataset = RLHFDataset(config.data.train_files, tokenizer, config.data, tools=tools, processor=processor)
        train_dataloader = create_train_dataloader(train_dataset, config.data, collate_fn)
    val_dataset = RLHFDataset(config.data.val_files, tokenizer, config.data, files_key="data.val_files", tools=tools,
                              processor=processor)
    reward_fn = load_reward_manager(config, tokenizer, num_examine=0)
    val_reward_fn = load_reward_manager(config, tokenizer, num_examine=1, training=False)
    return RayPPOTrainer(config, tokenizer, reward_fn, val_reward_fn, train_dataset, val_dataset, collate_fn,
                         train_dataloader)


def load_tokenizer(model_cfg: DictConfig, prefix: str):
    """The tokenizer of a model section (`tokenizer_path`, else `path`), on the driver; files that
    transformers cannot read end the run naming the key."""
    from hflow.workers.common import load_tokenizer

    key = f"{prefix}.tokenizer_path" if model_cfg.tokenizer_path else f"{prefix}.path"
    path = model_cfg.tokenizer_path or model_cfg.path
    try:
        return load_tokenizer(path, model_cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}={path}: the tokenizer does not load ({type(err).__name__}: "
                          f"{' '.join(str(err).split())}); fix or replace its files") from None


def plot_learning_curve(config: DictConfig) -> None:
    metrics_file = Path(config.trainer.log_dir) / "metrics.jsonl"
    if metrics_file.exists():
        from hflow.utils.plotting import plot_runs

        path = plot_runs([metrics_file], metrics_file.with_name("learning_curve.png"))
        print(f"learning curve: {path}")


def hflow_main(config_name: str):
    """`hydra.main` for an hflow entry point whose configuration is `<config_name>.yaml` of CONFIG_DIR, with the
    command line checked first: Hydra refuses an unknown key or a malformed argument itself, before
    `run_cli` can catch anything, with its own message (which names neither the key meant nor the keys
    that exist); `check_command_line` ends such a run as every other user error."""

    def decorate(task):
        hydra_main = hydra.main(config_path=CONFIG_DIR, config_name=config_name, version_base=None)(task)

        def main() -> None:
            try:
                check_command_line(sys.argv[1:], SCHEMAS[config_name])
            except UserError as err:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                _exit_with(err)
            hydra_main()

        main.__name__, main.__doc__ = task.__name__, task.__doc__
        return main

    return decorate


def check_command_line(argv: list[str], schema: type) -> None:
    """Every `key=value` or `~key` of `argv` reads as an override and names a key of `schema`. Hydra's
    own options and keys (`hydra.*`, config groups) pass, and so do `+key=value` additions, which
    `validate_config` judges once Hydra has added them. Every argument is checked: the errors of several
    come as one, a numbered line each."""
    from hydra._internal.utils import get_args_parser  # the parser hydra.main itself reads argv with
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    args, _ = get_args_parser().parse_known_args(argv)
    searchpath = any(text.lstrip("+~").startswith("hydra.searchpath") for text in args.overrides)
    if args.config_name and not args.config_path and not searchpath:  # else Hydra looks in folders of the user's
        folders = [Path(CONFIG_DIR)] + ([Path(args.config_dir)] if args.config_dir else [])
        name = args.config_name.removesuffix(".yaml")
        if not any((folder / f"{name}.yaml").is_file() for folder in folders):
            shipped = sorted(path.stem for path in Path(CONFIG_DIR).glob("*_trainer.yaml"))
            raise ConfigError(f"--config-name {args.config_name}: there is no {name}.yaml in "
                              f"{' or '.join(map(str, folders))}; give a file of --config-dir, or one of the shipped "
                              f"configurations ({', '.join(shipped)})")
    if args.config_name or args.config_path or args.config_dir:
        return  # another configuration than `schema` describes
    parser = OverridesParser.create()
    errors = ConfigErrors()
    for text in args.overrides:
        try:
            [override] = parser.parse_overrides([text])
        except OverrideParseException as err:
            reason = "; ".join(line for line in str(err).splitlines()
                               if line and not line.startswith(("Error parsing override", "See https://")))
            errors.add(ConfigError(f"cannot read the command-line argument {text!r} ({reason}); write it as "
                                   "key=value (https://hydra.cc/docs/advanced/override_grammar/basic)"))
            continue
        key = override.key_or_group
        if override.is_add() or override.is_force_add() or key.startswith("hydra.") or "/" in key:
            continue
        errors.run(check_override_key, key, schema)
    errors.raise_any()


@hflow_main("ppo_trainer")
def main(config: DictConfig) -> None:
    run_cli(run_ppo, config)


def run_cli(run, config: DictConfig) -> None:
    """What every hflow entry point does around `run(config, user_keys)`: quiet library noise; on Ctrl-C
    stop cleanly; a user's error (config, data, reward function) ends the run with its message alone."""
    from hydra.core.hydra_config import HydraConfig

    install_library_filter()
    user_keys = frozenset(o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task)
    try:
        run(config, user_keys)
    except KeyboardInterrupt:
        # run's cleanup has stopped the workers; stop a local Ray cluster too, then exit normally
        # so that every exit handler (scoring processes, loggers) runs.
        _stop_ray()
        print("interrupted: workers stopped", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - only the user's own errors are caught; the rest re-raise
        user_error = _user_error(err)
        if user_error is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _exit_with(user_error)


def _exit_with(user_error: UserError) -> None:
    """The fault is in the config, data or reward function, not in hflow: the message alone, as the last
    lines printed (Ray stopped first, so none of its shutdown messages follow it)."""
    _stop_ray()
    sys.stdout.flush()
    print(f"\nhflow: error: {user_error}", file=sys.stderr)
    sys.exit(1)


def _user_error(err: BaseException) -> UserError | None:
    """`err` itself when it is a UserError, or the one a worker raised (sent back inside a WorkerGroupError)."""
    if isinstance(err, UserError):
        return err
    cause = getattr(err, "user_error", None)
    return cause if isinstance(cause, UserError) else None


def _stop_ray() -> None:
    if "ray" in sys.modules:  # never import Ray just to stop it (the local backend runs without it)
        sys.modules["ray"].shutdown()


if __name__ == "__main__":
    main()
