"""Try the run's reward before the run: a few validation rows, each scored twice, with its ground truth and
with a wrong answer (`WRONG_ANSWER`) as the response.

A reward that cannot score (a file whose function raises, returns a string or takes too long, a remote
scorer whose URL nothing answers) is otherwise found only after Ray, the models and a whole generation have
started, and on a remote scorer the advice to score failures 0 would train on nothing. Preflight calls
`probe_reward` instead: the same reward manager the trainer builds (`load_reward_manager`), the same
scoring processes and timeout, the same result rules (`NaiveRewardManager.try_calls`), on
`PROBE_ROWS` rows of `data.val_files`. A remote scorer is tried once per request, with at most
`PROBE_REQUEST_TIMEOUT_S`, so a dead URL costs seconds, not its retries. Most generated responses are wrong:
a reward that scores only right answers (None, a string or an exception otherwise) is found by the wrong one.

With ``custom_reward_function.on_error=zero`` a local reward that fails on some rows (not all) only warns:
the user accepted failing samples scored 0. Not probed: a reward model or a generative judge alone (a model, loaded later by its worker), and a
user-registered manager that is not a `NaiveRewardManager` (its calling convention is its own).
"""

from __future__ import annotations

import copy
import numbers
from typing import Any

from omegaconf import DictConfig

from hflow.utils.errors import ConfigError

__all__ = ["PROBE_REQUEST_TIMEOUT_S", "PROBE_ROWS", "WRONG_ANSWER", "probe_reward"]

PROBE_ROWS = 4
PROBE_REQUEST_TIMEOUT_S = 10.0
WRONG_ANSWER = "I am not sure."  # a response that answers nothing, as many of a starting policy's do


def probe_reward(config: DictConfig) -> int:
    """Score `PROBE_ROWS` validation rows with their ground truth and with `WRONG_ANSWER` as the response; a
    ConfigError naming the row, the response, the reward and the reason when one cannot be scored. Returns the
    number of rows tried (0: not probed)."""
    from hflow.reward.managers import NaiveRewardManager, load_reward_manager

    section = config.custom_reward_function
    if not section.path and not section.url and config.reward_model.enable:
        return 0  # the reward model (or judge) scores: a model, tried when its worker loads it
    files = config.data.val_files
    path = str(files if isinstance(files, str) else files[0])
    rows = _probe_rows(path, config.data.reward_fn_key, config.data.val_split)
    if not rows:
        return 0  # no row says what to score against: the data checks name what is missing
    manager = load_reward_manager(config, tokenizer=None, num_examine=0, training=False)
    try:
        if not isinstance(manager, NaiveRewardManager):
            return 0
        if manager.remote is not None:  # one try per request, and not a minute of it
            manager.remote = copy.copy(manager.remote)
            manager.remote.max_retries = 0
            manager.remote.request_timeout_s = min(manager.remote.request_timeout_s, PROBE_REQUEST_TIMEOUT_S)
        # each row with its ground truth, then each with the wrong answer
        probes = [(index, response) for response in (None, WRONG_ANSWER) for index in range(len(rows))]
        calls = [dict(data_source=rows[index]["data_source"],
                      solution_str=str(rows[index]["ground_truth"]) if response is None else response,
                      ground_truth=rows[index]["ground_truth"], extra_info=rows[index]["extra_info"],
                      **manager.reward_kwargs) for index, response in probes]
        results = manager.try_calls(calls)
    finally:
        manager.close()
    failed = [i for i, result in enumerate(results) if isinstance(result, str)]
    if not failed:
        _check_weighted_keys(config, path, rows, probes, results)
        return len(rows)
    index, response = probes[failed[0]]
    first = _failure(config, path, index, rows[index], response, results[failed[0]])
    if section.on_error == "zero" and len(failed) < len(probes) and not section.url:
        # the user accepts failing samples scored 0; a reward that fails on every row would train on nothing
        print(f"reward probe: warning: {len(failed)} of {len(probes)} tries failed (on_error=zero scores such samples "
              f"0); the first: {first}", flush=True)
        return len(rows)
    raise ConfigError(first)


def _check_weighted_keys(config: DictConfig, path: str, rows: list, probes: list, results: list) -> None:
    """GDPO: every name of `algorithm.reward_weights` (but `score`) is a key of each probed result's dict."""
    weights = config.algorithm.get("reward_weights")
    if not weights:
        return
    for (index, response), result in zip(probes, results):
        extras = result[1] if isinstance(result, tuple) else {}
        for name in weights:
            if name != "score" and not isinstance(extras.get(name), numbers.Real):
                scored_with = "its ground truth" if response is None else f"the wrong answer {response!r}"
                raise ConfigError(
                    f"algorithm.reward_weights names {name!r}, but the reward function's result for row {index} of "
                    f"{path} (scored with {scored_with}) has no number under that key (its keys: "
                    f"{sorted(['score', *extras])}); return {{'score': ..., {name!r}: ...}} from the function or "
                    f"drop {name!r} from algorithm.reward_weights; nothing has started yet")


def _probe_rows(path: str, reward_fn_key: str, split: str | None = None) -> list[dict[str, Any]]:
    """The first `PROBE_ROWS` rows that carry a ground truth, as {data_source, ground_truth, extra_info}."""
    from hflow.utils.dataset.sources import read_schema, read_table

    where = {"split": split, "split_key": "data.val_split"}
    names = read_schema(path, "data.val_files", **where).names
    if reward_fn_key not in names or "reward_model" not in names:
        return []
    columns = [reward_fn_key, "reward_model"] + (["extra_info"] if "extra_info" in names else [])
    table = read_table(path, "data.val_files", columns=columns, **where).slice(0, PROBE_ROWS)
    return [{"data_source": row[reward_fn_key], "ground_truth": (row["reward_model"] or {}).get("ground_truth"),
             "extra_info": row.get("extra_info")} for row in table.to_pylist()
            if isinstance(row["reward_model"], dict) and "ground_truth" in row["reward_model"]]


def _failure(config: DictConfig, path: str, index: int, row: dict[str, Any], response: str | None,
             reason: str) -> str:
    """The message for row `index` scored with `response` (None: its ground truth) failing with `reason`."""
    section = config.custom_reward_function
    reason = " ".join(reason.strip().splitlines()[-1:]) if "Traceback" in reason else " ".join(reason.split())
    scored_with = (f"its ground truth {str(row['ground_truth'])[:60]!r}" if response is None else
                   f"a wrong answer {response!r}")
    where = f"row {index} of {path} (data_source={row['data_source']!r}), scored with {scored_with} as the response"
    if section.url:
        return (f"custom_reward_function.url={section.url}: the reward was tried before the run on {where} and "
                f"failed: {reason}. Start the scoring service (or fix the URL); nothing has started yet")
    label = f"custom_reward_function.path={section.path} (.name={section.name})" if section.path else \
        "the built-in scorer of that data_source"
    return (f"{label}: the reward was tried before the run on {where} and failed: {reason}. Fix the function "
            "so that it returns a number (or a dict with a 'score' key) for any response, right or wrong, within "
            "custom_reward_function.timeout_s; nothing has started yet")
