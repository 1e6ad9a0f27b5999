"""Try the run's reward before the run: a few validation rows, each with its ground truth as the response.

A reward that cannot score (a file whose function raises, returns a string or takes too long, a remote
scorer whose URL nothing answers) is otherwise found only after Ray, the models and a whole generation have
started, and on a remote scorer the advice to score failures 0 would train on nothing. Preflight calls
`probe_reward` instead: the same reward manager the trainer builds (`load_reward_manager`), the same
scoring processes and timeout, the same result rules (`NaiveRewardManager.try_calls`), on
`PROBE_ROWS` rows of `data.val_files`. A remote scorer is tried once per request, with at most
`PROBE_REQUEST_TIMEOUT_S`, so a dead URL costs seconds, not its retries.

Not probed: a reward model or a generative judge alone (a model, loaded later by its worker), and a
user-registered manager that is not a `NaiveRewardManager` (its calling convention is its own).
"""

from __future__ import annotations

import copy
from typing import Any

from omegaconf import DictConfig

from hflow.utils.errors import ConfigError

__all__ = ["PROBE_REQUEST_TIMEOUT_S", "PROBE_ROWS", "probe_reward"]

PROBE_ROWS = 4
PROBE_REQUEST_TIMEOUT_S = 10.0


def probe_reward(config: DictConfig) -> int:
    """Score `PROBE_ROWS` validation rows with their ground truth as the response; a ConfigError naming the
    row, the reward and the reason when one cannot be scored. Returns the number of rows tried (0: not
    probed)."""
    from hflow.reward.audit import read_rows
    from hflow.reward.managers import NaiveRewardManager, load_reward_manager

    section = config.custom_reward_function
    if not section.path and not section.url and config.reward_model.enable:
        return 0  # the reward model (or judge) scores: a model, tried when its worker loads it
    files = config.data.val_files
    path = str(files if isinstance(files, str) else files[0])
    rows = read_rows(path, PROBE_ROWS, config.data.reward_fn_key, config.data.prompt_key, "data.val_files")
    if not rows:
        return 0
    manager = load_reward_manager(config, tokenizer=None, num_examine=0, training=False)
    try:
        if not isinstance(manager, NaiveRewardManager):
            return 0
        if manager.remote is not None:  # one try per request, and not a minute of it
            manager.remote = copy.copy(manager.remote)
            manager.remote.max_retries = 0
            manager.remote.request_timeout_s = min(manager.remote.request_timeout_s, PROBE_REQUEST_TIMEOUT_S)
        calls = [dict(data_source=row["data_source"], solution_str=str(row["ground_truth"]),
                      ground_truth=row["ground_truth"], extra_info=row["extra_info"], **manager.reward_kwargs)
                 for row in rows]
        results = manager.try_calls(calls)
    finally:
        manager.close()
    for index, result in enumerate(results):
        if isinstance(result, str):
            raise ConfigError(_failure(config, path, index, rows[index], result))
    return len(rows)


def _failure(config: DictConfig, path: str, index: int, row: dict[str, Any], reason: str) -> str:
    section = config.custom_reward_function
    reason = " ".join(reason.strip().splitlines()[-1:]) if "Traceback" in reason else " ".join(reason.split())
    where = (f"row {index} of {path} (data_source={row['data_source']!r}), scored with its ground truth "
             f"{str(row['ground_truth'])[:60]!r} as the response")
    if section.url:
        return (f"custom_reward_function.url={section.url}: the reward was tried before the run on {where} and "
                f"failed: {reason}. Start the scoring service (or fix the URL); nothing has started yet")
    label = f"custom_reward_function.path={section.path} (.name={section.name})" if section.path else \
        "the built-in scorer of that data_source"
    return (f"{label}: the reward was tried before the run on {where} and failed: {reason}. Fix the function "
            "so that it returns a number (or a dict with a 'score' key) within custom_reward_function.timeout_s; "
            "nothing has started yet")
