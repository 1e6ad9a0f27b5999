"""NaiveRewardManager: score each response with a rule-based function and place the score on its last token.

Outcome rewards live on the last valid response token of ``token_level_scores`` (N, L); the
advantage estimators read them from there. User scoring functions run in worker processes with a
deadline (see `hflow.reward.runner`): a hung, crashing or misbehaving function stops the
run with a message naming the sample, or, with ``on_error="zero"``, scores 0 and is counted.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hflow.agent.loop import final_assistant_text
from hflow.protocol import DataProto
from hflow.utils.errors import UserError
from hflow.reward.score import default_compute_score
from hflow.reward import runner
from hflow.reward.runner import CallResult, ScoringPool
from hflow.reward.managers.registry import register
from hflow.utils.torch_functional import response_attention_mask

__all__ = ["NaiveRewardManager", "RewardFunctionError"]

_ON_ERROR = ("raise", "zero")
# A tensor the trainer adds to a cut view of the batch (algorithm.stop_token): the response mask as generated
# (N, L), which the overlong buffer measures.
GENERATED_RESPONSE_MASK = "generated_response_mask"


class RewardFunctionError(UserError, RuntimeError):
    """The reward function failed for a sample (raised, timed out, died or returned a non-number)."""


@register("naive")
class NaiveRewardManager:
    """Calls ``compute_score(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)`` per sample.

    Args:
        tokenizer: decodes prompts and responses (special tokens skipped).
        num_examine: decoded examples to print per data source and call (0 in training, 1 in validation).
        compute_score: the reward function; None means `default_compute_score` (by data source), or the
            reward model's ``rm_scores`` alone when the batch has them.
        reward_fn_key: non-tensor key holding each sample's data source (``data.reward_fn_key``).
        timeout_s: per-call limit in seconds; None calls the function in this process, without a limit
            (for debugging, or functions that cannot be pickled).
        on_error: ``"raise"`` stops at the first failure; ``"zero"`` scores failures 0 and counts them.
        num_workers: scoring processes; None means min(8, CPU count).
        overlong_buffer: a `hflow.reward.managers.dapo.OverlongBuffer`: DAPO's soft overlong penalty is
            added to each score (the one place it is applied; see that module for when the loader sets it).
        remote: a `hflow.reward.managers.remote.RemoteScorer` that scores instead of a local function
            (``custom_reward_function.url``); then `timeout_s` does not apply (the scorer has its own).
        **reward_kwargs: extra keyword arguments for every call.

    The function returns a number (bool, int, float) or a dict with a ``score`` key; the dict's other
    keys become per-sample ``reward_extra_info`` lists (None where a sample's result lacked the key).
    If the batch already has ``rm_scores`` (a reward model ran), a configured function's scores are
    added to them.
    """

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        timeout_s: float | None = 30.0,
        on_error: str = "raise",
        num_workers: int | None = None,
        overlong_buffer: Any = None,
        remote: Any = None,
        **reward_kwargs: Any,
    ) -> None:
        if remote is not None and compute_score is not None:
            raise ValueError("custom_reward_function: set either .path (a local function) or .url (a remote scorer)")
        if on_error not in _ON_ERROR:
            raise ValueError(f"custom_reward_function.on_error={on_error!r}; choose one of {list(_ON_ERROR)}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(
                f"custom_reward_function.timeout_s={timeout_s}; give a positive number of seconds, or null for no limit"
            )
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.has_rule_fn = compute_score is not None
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.num_workers = num_workers or min(8, os.cpu_count() or 1)
        self.reward_kwargs = reward_kwargs
        self.overlong_buffer = overlong_buffer
        self.remote = remote
        self.has_rule_fn = self.has_rule_fn or remote is not None
        self._pool: ScoringPool | None = None
        if timeout_s is not None and remote is None:
            # Fails now (not at the first step) if the function cannot reach a scoring process.
            self._pool = ScoringPool(self.compute_score, self.num_workers, timeout_s)

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        """Token-level scores (N, L) float32; with `return_dict`, also ``reward_extra_info`` (per-sample
        lists) and ``reward_metrics`` (``reward/errors``: samples scored 0 after a failure)."""
        rm_scores = data.batch.get("rm_scores", None)
        if rm_scores is not None and not self.has_rule_fn:
            reward_tensor, metrics = self._shape(data, rm_scores)
            return (
                {"reward_tensor": reward_tensor, "reward_extra_info": {}, "reward_metrics": metrics}
                if return_dict
                else reward_tensor
            )

        prompt_len = data.batch["prompts"].shape[-1]
        responses = data.batch["responses"]
        response_lengths = response_attention_mask(data.batch["attention_mask"], responses).sum(-1).tolist()
        calls = self._calls(data, prompt_len, response_lengths)
        scores, extras, failures = self._score(calls)
        reward_tensor = torch.zeros(responses.shape, dtype=torch.float32)
        for i, length in enumerate(response_lengths):
            # An empty response has no last token; its score goes to position 0 (outside the response mask).
            reward_tensor[i, max(length - 1, 0)] = scores[i]
        if rm_scores is not None:
            reward_tensor = reward_tensor + rm_scores.to(torch.float32)
        reward_tensor, metrics = self._shape(data, reward_tensor)
        metrics["reward/errors"] = len(failures)

        self._print_examples(data, prompt_len, calls, scores, extras)
        if not return_dict:
            return reward_tensor
        extra_info = _as_lists(extras)
        if self.on_error == "zero":
            extra_info["reward_error"] = [i in failures for i in range(len(data))]
        return {"reward_tensor": reward_tensor, "reward_extra_info": extra_info, "reward_metrics": metrics}

    def close(self) -> None:
        """Stop the scoring processes (they also stop when this manager is garbage-collected)."""
        if self._pool is not None:
            self._pool.close()

    def __getstate__(self) -> dict[str, Any]:
        # Processes do not travel (e.g. into a Ray task); the copy starts its own.
        state = dict(self.__dict__)
        state["_pool"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.timeout_s is not None and self.remote is None:
            self._pool = ScoringPool(self.compute_score, self.num_workers, self.timeout_s)

    # ---- what subclasses override -----------------------------------------------------------------

    def _calls(self, data: DataProto, prompt_len: int, response_lengths: list[int]) -> list[dict[str, Any]]:
        """Per sample, the keyword arguments of its scoring call (`reward_kwargs` included). A multi-turn
        sample (non-tensor ``episode``) is judged by its last assistant message, and its extra_info
        carries the whole episode."""
        responses = data.batch["responses"]
        solutions = self.tokenizer.batch_decode(
            [responses[i, :length].tolist() for i, length in enumerate(response_lengths)], skip_special_tokens=True
        )
        episodes = data.non_tensor_batch.get("episode")
        if episodes is not None:  # multi-turn: the final answer is judged, the whole episode is visible
            solutions = [final_assistant_text(episode) for episode in episodes]
        data_sources = self._column(data, self.reward_fn_key, "data.reward_fn_key")
        ground_truths = [
            _ground_truth(entry, i) for i, entry in enumerate(self._column(data, "reward_model", "the dataset"))
        ]
        extra_infos = data.non_tensor_batch.get("extra_info", np.full(len(data), None, dtype=object))
        if episodes is not None:
            extra_infos = [{**(info or {}), "episode": episode} for info, episode in zip(extra_infos, episodes)]
        return [
            dict(
                data_source=data_sources[i],
                solution_str=solutions[i],
                ground_truth=ground_truths[i],
                extra_info=extra_infos[i],
                **self.reward_kwargs,
            )
            for i in range(len(data))
        ]

    def _outcomes(self, calls: list[dict[str, Any]]) -> list[CallResult | None]:
        """One outcome per call (None: not run, an earlier failure stopped the batch): the remote scorer's,
        or the function's, one call per sample (in the scoring processes, or inline without a timeout)."""
        if self.remote is not None:
            return self.remote.score(calls)
        if self._pool is None:
            return [call_inline(self.compute_score, call) for call in calls]
        return self._pool.map(calls, stop_on_error=self.on_error == "raise")

    # ---- internals -------------------------------------------------------------------------------

    def _shape(self, data: DataProto, reward_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The overlong buffer's penalty added (when this manager has one), and its metrics."""
        if self.overlong_buffer is None:
            return reward_tensor, {}
        mask = data.batch.get(GENERATED_RESPONSE_MASK, None)
        if mask is None:
            mask = response_attention_mask(data.batch["attention_mask"], data.batch["responses"])
        return self.overlong_buffer.apply(reward_tensor, mask)

    @staticmethod
    def _column(data: DataProto, key: str, source: str) -> np.ndarray:
        if key not in data.non_tensor_batch:
            raise KeyError(
                f"reward: the batch has no non-tensor {key!r} (set by {source}); it has {sorted(data.non_tensor_batch)}"
            )
        return data.non_tensor_batch[key]

    def try_calls(self, calls: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any]] | str | None]:
        """Per call, (score, extra keys) or the reason it is unusable (None: not run, an earlier failure
        stopped the batch): the function or the remote scorer run exactly as for a batch, the results checked
        by the same rules. What the trainer's preflight tries the reward with (`hflow.reward.probe`)."""
        return [None if outcome is None else _parse_result(outcome) for outcome in self._outcomes(calls)]

    def _score(self, calls: list[dict[str, Any]]) -> tuple[list[float], list[dict[str, Any]], dict[int, str]]:
        """Run every call; per sample its score and extra keys, plus {index: reason} for failures."""
        scores, extras, failures = [0.0] * len(calls), [{} for _ in calls], {}
        for i, parsed in enumerate(self.try_calls(calls)):
            if parsed is None:  # not run: an earlier failure stopped the batch
                continue
            if isinstance(parsed, str):
                failures[i] = parsed
            else:
                scores[i], extras[i] = parsed
        if failures:
            first = min(failures)
            where = f"sample {first} (data_source={calls[first]['data_source']!r})"
            reason = _one_line(failures[first])
            if self.on_error == "raise":
                # A service that does not answer fails every sample: scoring them 0 would train on nothing.
                advice = (f"check that the scoring service at custom_reward_function.url={self.remote.url} answers"
                          if self.remote is not None else
                          "fix the function, or set custom_reward_function.on_error=zero to score such samples 0")
                raise RewardFunctionError(
                    f"reward function {self.remote or self.compute_score!r} failed on {where}: {reason}; {advice}")
            print(
                f"[reward] {len(failures)}/{len(calls)} samples failed and were scored 0 (on_error=zero); "
                f"first: {where}: {reason}"
            )
        return scores, extras, failures

    def _print_examples(
        self,
        data: DataProto,
        prompt_len: int,
        calls: list[dict[str, Any]],
        scores: list[float],
        extras: list[dict[str, Any]],
    ) -> None:
        printed: dict[str, int] = {}
        for i, call in enumerate(calls):
            data_source = call["data_source"]
            if printed.get(data_source, 0) >= self.num_examine:
                continue
            printed[data_source] = printed.get(data_source, 0) + 1
            prompt_mask = data.batch["attention_mask"][i, :prompt_len].bool()
            prompt = self.tokenizer.decode(data.batch["prompts"][i][prompt_mask].tolist(), skip_special_tokens=True)
            print(
                f"[prompt] {prompt}\n[response] {call['solution_str']}\n[ground_truth] {call['ground_truth']}\n"
                f"[score] {scores[i]}"
            )
            for key, value in extras[i].items():
                print(f"[{key}] {value}")


def _ground_truth(entry: Any, index: int) -> Any:
    if not isinstance(entry, dict) or "ground_truth" not in entry:
        raise KeyError(
            f"reward: sample {index} has reward_model={entry!r}; rule-based scoring needs a dict with a "
            "'ground_truth' key (see the data schema in examples/data_preprocess/gsm8k.py)"
        )
    return entry["ground_truth"]


def call_inline(fn: Callable[..., Any], call: dict[str, Any]) -> CallResult:
    """`fn(**call)` in this process, as a `CallResult` (a raise becomes its traceback, for the caller to judge)."""
    try:
        return CallResult(value=fn(**call))
    except Exception:  # noqa: BLE001 - user code: the caller decides (raise or score 0)
        return CallResult(error=traceback.format_exc())


_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def _one_line(reason: str) -> str:
    """A failure's reason on one line, for the one-line message the run ends with: a traceback becomes its
    exception and the frames it came through, innermost first (without FileFunction's own call)."""
    lines = reason.rstrip().splitlines()
    if not lines or not lines[0].startswith("Traceback"):
        return " ".join(line.strip() for line in lines)
    frames = [match for match in map(_FRAME.match, lines) if match and match["file"] != runner.__file__]
    after_frames = max(i for i, line in enumerate(lines) if line.startswith("  ")) + 1
    exception = " ".join(line.strip() for line in lines[after_frames:])
    where = ", called from ".join(f"{m['file']} line {m['line']} in {m['func']}" for m in reversed(frames[-4:]))
    return f"raised {exception}" + (f" at {where}" if where else "")


def _parse_result(outcome: CallResult) -> tuple[float, dict[str, Any]] | str:
    """(score, extra keys) from a call's outcome, or the reason it is unusable."""
    if not outcome.ok:
        return outcome.error
    value, extras = outcome.value, {}
    if isinstance(value, dict):
        if "score" not in value:
            return f"returned a dict without a 'score' key (keys: {sorted(value)})"
        extras = {key: item for key, item in value.items() if key != "score"}
        value = value["score"]
    if not isinstance(value, (numbers.Real, np.bool_)):
        return f"returned {value!r} ({type(value).__name__}); return a float/int/bool or a dict with a 'score' key"
    score = float(value)
    if not math.isfinite(score):
        return f"returned {score}; scores must be finite numbers"
    return score, extras


def _as_lists(extras: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Per-sample dicts → one list per key (None where a sample lacks the key), keys in first-seen order."""
    keys = list(dict.fromkeys(key for sample in extras for key in sample))
    return {key: [sample.get(key) for sample in extras] for key in keys}
