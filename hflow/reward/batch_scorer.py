"""`BatchScorer`: every score the PPO trainer needs for a batch of sampled responses, in one place.

The trainer hands it a batch (prompts with their responses) and gets the token-level scores and the
reward metrics back. Behind that call: the reward function (`reward_fn`: a reward manager), the reward
model (`rm_wg`, when `reward_model.enable`), its normalisation (`reward_model.normalize`), the stop token
(`algorithm.stop_token`, `algorithm.missing_stop_penalty`) and the ReMax greedy baseline. Validation
scores (`val_reward_fn`) come from here too.
"""

from __future__ import annotations

import numpy as np
import torch

from hflow.protocol import DataProto
from hflow.reward import shaping as reward_shaping
from hflow.reward.managers.dapo import GENERATED_RESPONSE_MASK
from hflow.utils.torch_functional import response_attention_mask
from hflow.workers.fsdp_workers import RewardModelWorker


def response_mask(batch: DataProto) -> torch.Tensor:
    """The response part of `attention_mask` (1 on every generated token, 0 on padding)."""
    return response_attention_mask(batch.batch["attention_mask"], batch.batch["responses"])


def reward_extra_metrics(extra_info: dict[str, list]) -> dict[str, float]:
    """`reward/<key>/mean` of each numeric column the reward function returned beside the score."""
    metrics = {}
    for key, values in extra_info.items():
        numeric = [float(v) for v in values if isinstance(v, (int, float, bool, np.number))]
        if numeric and len(numeric) == len(values):
            metrics[f"reward/{key}/mean"] = float(np.mean(numeric))
    return metrics


class BatchScorer:
    """Scores batches of responses for training and validation.

    `rm_wg` (the reward model's worker group) is set once the workers exist; `reward_norm` is the fitted
    normalisation of its scores (None when `reward_model.normalize` is off) and is checkpointed by the trainer.
    """

    def __init__(self, config, tokenizer, reward_fn, val_reward_fn=None):
        self.config = config
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.use_rm = bool(config.reward_model.enable)
        self.rm_wg = None
        # algorithm.stop_token (checked by preflight to be one token of this tokenizer) and reward_model.normalize
        algo = config.algorithm
        self.stop_token_id = (None if algo.stop_token is None
                              else reward_shaping.resolve_stop_token_id(tokenizer, algo.stop_token))
        self.reward_norm = (reward_shaping.RewardNormalization()
                            if self.use_rm and config.reward_model.normalize.enable else None)

    # ------------------------------------------------------------------ training

    def score_training(self, batch: DataProto) -> tuple[torch.Tensor, dict, dict[str, float]]:
        """The samples' `token_level_scores`, the reward function's full result, and every reward metric
        (shaping, the reward function's own, the means of its numeric extra columns)."""
        scores, reward, metrics = self.score(batch)
        metrics.update(reward.get("reward_metrics", {}))
        metrics.update(reward_extra_metrics(reward.get("reward_extra_info", {})))
        return scores, reward, metrics

    def score(self, batch: DataProto, reward_fn=None) -> tuple[torch.Tensor, dict, dict[str, float]]:
        """Token-level scores of `batch`'s responses, `reward_fn`'s (default: the training reward
        function's) full result and the shaping metrics.

        The reward model (its scores normalised when `reward_model.normalize` is on) and `reward_fn` see
        each response cut after `algorithm.stop_token`; a response without it then scores
        `algorithm.missing_stop_penalty` (when set). DAPO's soft overlong penalty, when on, is `reward_fn`'s
        (the training reward manager's; see `hflow.reward.managers.dapo`). `batch` stays as generated.
        """
        reward_fn = self.reward_fn if reward_fn is None else reward_fn
        view, has_stop = batch, None
        if self.stop_token_id is not None:
            view, has_stop = reward_shaping.stop_token_view(batch, self.stop_token_id, self.tokenizer.pad_token_id)
        if self.use_rm:
            view = view.union(self.rm_scores(view))
        if has_stop is not None:  # the overlong buffer measures the responses as generated, not as cut
            view.batch[GENERATED_RESPONSE_MASK] = response_mask(batch)
        reward = reward_fn(view, return_dict=True)
        scores, metrics = reward["reward_tensor"], {}
        if has_stop is not None:
            scores, metrics = reward_shaping.finish_stop_token_scores(
                scores, response_mask(batch), has_stop, self.config.algorithm.missing_stop_penalty)
        return scores, reward, metrics

    def greedy_baseline(self, batch: DataProto, greedy: DataProto) -> torch.Tensor:
        """ReMax: the reward of the greedy response (`greedy`, generated for `batch`'s prompts) is each
        prompt's baseline, scored as the samples are."""
        scored = DataProto(batch=batch.batch.clone(), non_tensor_batch=dict(batch.non_tensor_batch)).union(greedy)
        baseline = self.score(scored)[0].sum(-1)
        clip = self.config.algorithm.reward_clip
        return baseline if clip is None else baseline.clamp(-float(clip), float(clip))

    def rm_scores(self, batch: DataProto) -> DataProto:
        """The reward model's `rm_scores`, normalised with the fitted gain and bias (reward_model.normalize)."""
        output = self.rm_wg.call(RewardModelWorker.compute_rm_score, batch)
        if self.reward_norm is not None and self.reward_norm.fitted:
            output.batch["rm_scores"] = self.reward_norm.apply(output.batch["rm_scores"], response_mask(batch))
        return output

    def fit_normalization(self, dataset, collate_fn, generate) -> None:
        """lm-human-preferences: sample one response (training sampling settings) for each of
        `reward_model.normalize.num_prompts` training prompts, drawn with a seeded generator straight from
        the dataset (the training loader does not move), score them with the reward model, and fit a gain
        and bias that give those scores mean 0 and std 1. `generate(batch, n=1)`: `batch` with a response
        to each prompt, sampled by the current policy."""
        num = int(self.config.reward_model.normalize.num_prompts)
        generator = torch.Generator().manual_seed(int(self.config.data.seed))
        order = torch.randperm(len(dataset), generator=generator)
        indices = order[torch.arange(num) % len(order)].tolist()  # repeats prompts only when there are fewer
        batch = generate(DataProto.from_single_dict(collate_fn([dataset[i] for i in indices])), n=1)
        if self.stop_token_id is not None:  # fit on what the reward model sees in training
            batch, _ = reward_shaping.stop_token_view(batch, self.stop_token_id, self.tokenizer.pad_token_id)
        rm_scores = self.rm_wg.call(RewardModelWorker.compute_rm_score, batch).batch["rm_scores"]
        has_response = response_mask(batch).sum(-1) > 0
        self.reward_norm.fit(rm_scores.sum(-1)[has_response])
        print(f"reward_model.normalize: gain={self.reward_norm.gain:.6g} bias={self.reward_norm.bias:.6g} "
              f"from {int(has_response.sum())} samples")

    def norm_metrics(self) -> dict[str, float]:
        return {} if self.reward_norm is None else self.reward_norm.metrics()

    # ------------------------------------------------------------------ validation

    def score_validation(self, batch: DataProto) -> tuple[list[float], dict[str, list]]:
        """Each response's task score and the extra columns to report beside it.

        The task score: the rule score of the response (cut after algorithm.stop_token when set, but never
        replaced by missing_stop_penalty, nor clipped: those shape training only). With a reward model, its
        score is reported beside it (`rm_score`), normalised as in training."""
        view = batch if self.stop_token_id is None else reward_shaping.stop_token_view(
            batch, self.stop_token_id, self.tokenizer.pad_token_id)[0]
        result = self.val_reward_fn(view, return_dict=True)
        extra: dict[str, list] = {}
        if self.use_rm:
            extra["rm_score"] = self.rm_scores(view).batch["rm_scores"].sum(-1).tolist()
        for key, values in result.get("reward_extra_info", {}).items():
            extra[key] = extra.get(key, []) + list(values)
        return result["reward_tensor"].sum(-1).tolist(), extra
