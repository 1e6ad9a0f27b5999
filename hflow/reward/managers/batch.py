"""BatchRewardManager: one call of the user's function per batch, with lists (verl's ``batch`` manager).

Everything but the call is `NaiveRewardManager`'s: the inputs (multi-turn episodes included), the result
rules (a number, or a dict whose ``score`` is the score and whose other keys become ``reward_extra_info``),
placement on the last valid response token, ``on_error``, the overlong buffer and the examples printed.
"""

from __future__ import annotations

from typing import Any

from hflow.reward.runner import CallResult
from hflow.reward.managers.naive import NaiveRewardManager, call_inline
from hflow.reward.managers.registry import register

__all__ = ["BATCH_ARGUMENTS", "BatchRewardManager"]

# The per-sample arguments, as the lists the batch function receives (beside `reward_kwargs`).
BATCH_ARGUMENTS = {"data_sources": "data_source", "solution_strs": "solution_str", "ground_truths": "ground_truth",
                   "extra_infos": "extra_info"}


@register("batch")
class BatchRewardManager(NaiveRewardManager):
    """Calls ``compute_score(data_sources, solution_strs, ground_truths, extra_infos, **reward_kwargs)`` once
    per batch; it returns one result per sample (a list or tuple, in order).

    The call runs in a scoring process with `timeout_s` for the whole call (or inline when None). A call that
    raises or times out fails every sample (with ``on_error=zero`` all score 0); a result list of the wrong
    length fails the samples it leaves without a result (or, when too long, every sample), and an entry that
    is not a number fails its sample: each message names the sample and its data source. Without a function
    (``custom_reward_function.path`` unset) the default scorers score each sample, as in naive.
    """

    def _outcomes(self, calls: list[dict[str, Any]]) -> list[CallResult | None]:
        if self.remote is not None or not calls or not self.has_rule_fn:
            return super()._outcomes(calls)
        batch_call = {name: [call[key] for call in calls] for name, key in BATCH_ARGUMENTS.items()}
        batch_call.update(self.reward_kwargs)
        if self._pool is None:
            outcome = call_inline(self.compute_score, batch_call)
        else:
            outcome = self._pool.map([batch_call])[0]
        return split_batch_result(outcome, len(calls))


def split_batch_result(outcome: CallResult, n: int) -> list[CallResult]:
    """One outcome per sample from the outcome of a call that scored `n` samples at once."""
    if not outcome.ok:
        return [outcome] * n
    results = outcome.value
    if not isinstance(results, (list, tuple)):
        return [CallResult(error=f"the batch call returned {type(results).__name__} {_excerpt(results)}; "
                                 f"return a list of {n} results (floats or dicts with a 'score' key)")] * n
    if len(results) > n:
        return [CallResult(error=f"the batch call returned {len(results)} results for {n} samples")] * n
    missing = CallResult(error=f"the batch call returned {len(results)} results for {n} samples: none for this one")
    return [CallResult(value=value) for value in results] + [missing] * (n - len(results))


def _excerpt(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
