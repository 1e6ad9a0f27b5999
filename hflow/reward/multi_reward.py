"""Several named rewards per sample (GDPO, `algorithm.adv_estimator=gdpo` with `algorithm.reward_weights`).

A reward function that returns a dict gives the trainer its `score` and, per other key, a column of
`reward_extra_info` (one value per sample). With `algorithm.reward_weights` set, the batch carries each
weighted reward as a declared column of `non_tensor_batch`, `reward_score/<name>` (float64, one per sample),
so it travels through DAPO's group filter, concat and the worker dispatch like `uid` does; the advantage
estimator reads the columns back. The name `score` is the reward function's score itself (the sum of
`token_level_scores`), so a weight can name it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hflow.algorithms.advantages import gdpo_weighted_parts
from hflow.utils.errors import UserError

SCORE_KEY = "score"


def reward_column(name: str) -> str:
    """The `non_tensor_batch` key of reward `name`."""
    return f"reward_score/{name}"


def attach_reward_columns(batch: Any, extra_info: Mapping[str, list], weights: Mapping[str, float]) -> None:
    """Write `reward_score/<name>` for each name of `weights` from the reward function's extra keys (the
    `score` from `token_level_scores`); a key the function did not return for every sample stops the run
    naming it (preflight's reward probe finds it earlier on a few rows)."""
    for name in weights:
        if name == SCORE_KEY:
            values = batch.batch["token_level_scores"].sum(dim=-1).double().cpu().numpy()
        else:
            column = extra_info.get(name)
            if column is None or any(not isinstance(v, (int, float, bool, np.number)) for v in column):
                returned = sorted(extra_info)
                raise UserError(f"algorithm.reward_weights names {name!r}, but the reward function did not return a "
                                f"number under that key for every sample (its extra keys: {returned}); return "
                                f"{{'score': ..., {name!r}: ...}} from the function, or drop {name!r} from "
                                "algorithm.reward_weights")
            values = np.asarray(column, dtype=np.float64)
        batch.non_tensor_batch[reward_column(name)] = values


def reward_scores(batch: Any, weights: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """The per-sample scores (N,) of each weighted reward, read back from the batch's columns."""
    return {name: torch.as_tensor(np.asarray(batch.non_tensor_batch[reward_column(name)], dtype=np.float64))
            for name in weights}


def gdpo_metrics(scores: Mapping[str, torch.Tensor], weights: Mapping[str, float], index: Any,
                 by_std: bool) -> dict[str, float]:
    """`reward/<name>/adv_share`: the share of the summed advantage's size that reward `name` moves,
    mean |w_k A^k| / sum_j mean |w_j A^j| (before the batch normalization, which scales all alike)."""
    parts = gdpo_weighted_parts(scores, weights, index, by_std=by_std)
    sizes = {name: part.abs().mean().item() for name, part in parts.items()}
    total = sum(sizes.values())
    return {f"reward/{name}/adv_share": (size / total if total > 0 else 0.0) for name, size in sizes.items()}
