"""Metrics the trainer logs each step and after validation, under verl's names.

Dashboards and log parsers written for verl read these keys (``critic/score/mean``,
``response_length/mean``, ``timing_s/gen``, ``perf/throughput``, ``val-core/<data_source>/...``), so
the names and formulas are kept as verl has them.
"""

from __future__ import annotations

import numbers
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hflow.protocol import DataProto
from hflow.utils.torch_functional import response_attention_mask

__all__ = [
    "bootstrap_metric",
    "calc_maj_val",
    "compute_data_metrics",
    "compute_throughout_metrics",
    "compute_timing_metrics",
    "format_validation_metrics",
    "process_validation_metrics",
    "reduce_metrics",
]

# Timers whose per-token cost is reported, and which tokens they process.
_RESPONSE_TOKEN_TIMERS = ("gen",)
_ALL_TOKEN_TIMERS = ("old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")


def reduce_metrics(metrics: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """One number per key from per-rank or per-micro-batch lists (returns a new dict).

    Keys with a ``max`` or ``min`` word (``perf/max_memory_allocated_gb``, ``timing_s/gen_max``) take
    the max or min; every other key the mean. An empty list gives NaN.
    """
    reduced = {}
    for key, values in metrics.items():
        array = np.asarray([float(value) for value in values], dtype=np.float64)
        words = set(re.split(r"[/_]", key))
        if array.size == 0:
            reduced[key] = float("nan")
        elif "max" in words:
            reduced[key] = float(array.max())
        elif "min" in words:
            reduced[key] = float(array.min())
        else:
            reduced[key] = float(array.mean())
    return reduced


def _response_info(batch: DataProto) -> dict[str, torch.Tensor]:
    """Per-sample prompt and response lengths and the response mask, from the attention mask."""
    response_len = batch.batch["responses"].shape[-1]
    attention_mask = batch.batch["attention_mask"]
    response_mask = batch.batch.get("response_mask", response_attention_mask(attention_mask, batch.batch["responses"]))
    return {
        "response_mask": response_mask.bool(),
        "prompt_length": attention_mask[:, :-response_len].sum(-1).float(),
        "response_length": response_mask.sum(-1).float(),
    }


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    """``name/mean``, ``name/max``, ``name/min`` (NaN when there are no values)."""
    if values.numel() == 0:
        return {f"{name}/mean": float("nan"), f"{name}/max": float("nan"), f"{name}/min": float("nan")}
    values = values.float()
    return {
        f"{name}/mean": values.mean().item(),
        f"{name}/max": values.max().item(),
        f"{name}/min": values.min().item(),
    }


def compute_mixture_metrics(batch: DataProto, files: Sequence[str]) -> dict[str, float]:
    """``data/rows_from/<i>_<file name>``: the prompts of this step drawn from each `data.mixture` file (items carry
    their file's index as ``data_file``; a prompt's n responses share its ``uid`` and count once)."""
    sources = batch.non_tensor_batch.get("data_file")
    if sources is None:
        return {}
    uids = batch.non_tensor_batch.get("uid")
    prompts = {(uid, int(i)) for uid, i in zip(uids, sources)} if uids is not None else enumerate(sources)
    counts = Counter(int(i) for _, i in prompts)
    return {f"data/rows_from/{i}_{name.rstrip('/').rsplit('/', 1)[-1]}": float(counts.get(i, 0))
            for i, name in enumerate(files)}


def compute_data_metrics(batch: DataProto, use_critic: bool = True, max_prompt_length: int | None = None) -> dict[str, float]:
    """Scores, rewards, advantages, returns (and values) over valid response tokens, and lengths.

    Needs ``token_level_scores``, ``token_level_rewards``, ``advantages``, ``returns``, ``responses``,
    ``attention_mask`` (and ``values`` with a critic).
    """
    info = _response_info(batch)
    mask = info["response_mask"]
    max_response_length = batch.batch["responses"].shape[-1]
    if max_prompt_length is None:  # batches are only as wide as their longest prompt: pass the limit
        max_prompt_length = batch.batch["attention_mask"].shape[-1] - max_response_length

    metrics = {
        **_stats("critic/score", batch.batch["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", torch.masked_select(batch.batch["advantages"], mask)),
        **_stats("critic/returns", torch.masked_select(batch.batch["returns"], mask)),
    }
    if use_critic:
        values = torch.masked_select(batch.batch["values"], mask).float()
        returns = torch.masked_select(batch.batch["returns"], mask).float()
        metrics.update(_stats("critic/values", values))
        metrics["critic/vf_explained_var"] = _explained_variance(returns, values)
    for name, lengths, limit in (
        ("response_length", info["response_length"], max_response_length),
        ("prompt_length", info["prompt_length"], max_prompt_length),
    ):
        metrics.update(_stats(name, lengths))
        metrics[f"{name}/clip_ratio"] = (lengths == limit).float().mean().item()
    return metrics


def _explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """``1 - Var(returns - values) / (Var(returns) + 1e-5)``; NaN with fewer than two tokens."""
    if returns.numel() < 2:
        return float("nan")
    return (1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)).item()


def compute_timing_metrics(batch: DataProto, timing_raw: Mapping[str, float]) -> dict[str, float]:
    """``timing_s/<name>`` for every timer and ``timing_per_token_ms/<name>`` for the token-bound phases:
    generation per response token, the forward/backward phases per prompt + response token."""
    info = _response_info(batch)
    response_tokens = info["response_length"].sum().item()
    all_tokens = response_tokens + info["prompt_length"].sum().item()
    tokens = {name: response_tokens for name in _RESPONSE_TOKEN_TIMERS}
    tokens.update({name: all_tokens for name in _ALL_TOKEN_TIMERS})

    metrics = {f"timing_s/{name}": float(seconds) for name, seconds in timing_raw.items()}
    for name, seconds in timing_raw.items():
        if name in tokens and tokens[name] > 0:
            metrics[f"timing_per_token_ms/{name}"] = 1000.0 * seconds / tokens[name]
    return metrics


def compute_throughout_metrics(batch: DataProto, timing_raw: Mapping[str, float], n_gpus: int) -> dict[str, float]:
    """``perf/total_num_tokens``, ``perf/time_per_step`` and ``perf/throughput`` (tokens per second per
    device). Tokens are ``meta_info["global_token_num"]`` (per-sample attention-mask sums); computed
    from the attention mask when the trainer did not set it."""
    token_counts = batch.meta_info.get("global_token_num")
    if token_counts is None:
        token_counts = batch.batch["attention_mask"].sum(-1).tolist()
    total_tokens = float(sum(token_counts))
    time = float(timing_raw["step"])
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": time,
        "perf/throughput": total_tokens / (time * n_gpus),
    }


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def bootstrap_metric(
    data: Sequence[Any],
    subset_size: int,
    reduce_fns: Sequence[Callable[[np.ndarray], float]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """(mean, std) of each ``reduce_fn`` over `n_bootstrap` resamples of `subset_size` items (with
    replacement). Seeded with its own generator: the global numpy RNG is left alone. Empty data
    raises ValueError."""
    rng = np.random.default_rng(seed)
    samples = [[] for _ in reduce_fns]
    for _ in range(n_bootstrap):
        subset = [data[i] for i in rng.choice(len(data), size=subset_size, replace=True)]
        for values, reduce_fn in zip(samples, reduce_fns, strict=True):
            values.append(reduce_fn(subset))
    return [(float(np.mean(values)), float(np.std(values))) for values in samples]


def calc_maj_val(data: Sequence[Mapping[str, Any]], vote_key: str, val_key: str) -> Any:
    """`val_key` of the first item whose `vote_key` is the most common (majority voting; ties go to
    the value seen first)."""
    counts = Counter(item[vote_key] for item in data)
    majority = max(counts, key=counts.get)  # max keeps the first of equal counts, in first-seen order
    return next(item[val_key] for item in data if item[vote_key] == majority)


def process_validation_metrics(
    data_sources: Sequence[str], sample_inputs: Sequence[str], infos_dict: Mapping[str, Sequence[Any]], seed: int = 42
) -> dict[str, dict[str, dict[str, float]]]:
    """Per data source, per variable, per metric: ``{data_source: {var: {metric: value}}}``.

    Samples are grouped by data source and prompt (`sample_inputs`); a prompt with n samples gives
    ``mean@n``, and when n > 1 also ``std@n`` and, for k = 2, 4, 8, ... < n and k = n, bootstrapped
    ``best@k/mean|std`` and ``worst@k/mean|std`` (and ``maj@k/mean|std`` when `infos_dict` has a
    ``pred`` variable to vote on). Each metric is then averaged over the prompts of a data source.
    Variables with a non-numeric value (a string, or None for a failed sample) are skipped.
    """
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for index, (data_source, prompt) in enumerate(zip(data_sources, sample_inputs, strict=True)):
        groups[data_source][prompt].append(index)

    numeric = {
        var: values
        for var, values in infos_dict.items()
        if all(isinstance(value, (numbers.Real, np.bool_)) for value in values)
    }
    preds = infos_dict.get("pred")
    result: dict[str, dict[str, dict[str, float]]] = {}
    for data_source, prompts in groups.items():
        per_var: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for indices in prompts.values():
            for var, values in numeric.items():
                samples = [values[i] for i in indices]
                votes = [{"pred": preds[i], "val": values[i]} for i in indices] if preds is not None else None
                for metric, value in _prompt_metrics(samples, votes, seed).items():
                    per_var[var][metric].append(value)
        result[data_source] = {
            var: {metric: float(np.mean(values)) for metric, values in metrics.items()}
            for var, metrics in per_var.items()
        }
    return result


def _prompt_metrics(samples: list[float], votes: list[dict[str, Any]] | None, seed: int) -> dict[str, float]:
    """The metrics of one prompt's n samples of one variable."""
    n = len(samples)
    metrics = {f"mean@{n}": float(np.mean(samples))}
    if n == 1:
        return metrics
    metrics[f"std@{n}"] = float(np.std(samples))
    ks = [2**i for i in range(1, n.bit_length()) if 2**i < n] + [n]
    for k in ks:
        (best_mean, best_std), (worst_mean, worst_std) = bootstrap_metric(samples, k, [np.max, np.min], seed=seed)
        metrics[f"best@{k}/mean"], metrics[f"best@{k}/std"] = best_mean, best_std
        metrics[f"worst@{k}/mean"], metrics[f"worst@{k}/std"] = worst_mean, worst_std
        if votes is not None:
            [(maj_mean, maj_std)] = bootstrap_metric(
                votes, k, [lambda subset: calc_maj_val(subset, vote_key="pred", val_key="val")], seed=seed
            )
            metrics[f"maj@{k}/mean"], metrics[f"maj@{k}/std"] = maj_mean, maj_std
    return metrics


def format_validation_metrics(processed: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, float]:
    """Flat names for `process_validation_metrics` output: ``val-core/<data_source>/<var>/<metric>`` for
    the headline numbers, ``val-aux/...`` for the rest.

    The core variable is ``acc`` when the reward function reports one, else ``reward``; its core
    metrics are ``mean@n``, ``maj@n/*`` and ``best@n/*`` at the largest n of that data source (so a
    greedy validation with one sample per prompt logs ``val-core/<data_source>/reward/mean@1``).
    """
    flat = {}
    for data_source, variables in processed.items():
        core_var = "acc" if "acc" in variables else "reward"
        n_max = max((_sample_count(metric) for metrics in variables.values() for metric in metrics), default=1)
        for var, metrics in variables.items():
            for metric, value in metrics.items():
                is_core = (
                    var == core_var and metric.startswith(("mean", "maj", "best")) and _sample_count(metric) == n_max
                )
                section = "val-core" if is_core else "val-aux"
                flat[f"{section}/{data_source}/{var}/{metric}"] = value
    return flat


def _sample_count(metric: str) -> int:
    """The n (or k) of a metric name: ``mean@4`` → 4, ``best@2/std`` → 2."""
    return int(metric.split("@")[1].split("/")[0])
