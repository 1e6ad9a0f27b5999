"""A generative reward model (GenRM, LLM-as-judge): `reward_model.style=generative`.

`GenerativeRewardModelWorker` has the reward role's interface (`init_model`, `compute_rm_score` into
`rm_scores`, the score at each response's last valid token, as `RewardModelWorker`), but its model is a
chat model (`reward_model.model.path`, a causal LM) served by its own in-process vLLM engine
(`VLLMJudge`, built with the rollout's `vLLMRollout._engine_kwargs` and real weights). For each sample
it renders the judge's user message (`hflow.reward.judge.render_judge_prompt`: the question -- the row's
last user message --, the response decoded with the policy's tokenizer, and the row's
`reward_model.ground_truth` as the reference), applies the judge's chat template with a generation
prompt, and parses the judge's answer (`reward_model.judge.parser`):

* ``yes_no`` -- exact, by prompt log-probs: two requests per sample, the judge prompt followed by the
  tokens of ``yes_word`` and by those of ``no_word``, each with ``prompt_logprobs=0`` and one sampled
  token that is discarded. vLLM returns the log-prob of every prompt token under the full-vocabulary
  log-softmax of the raw logits, so summing those of the word's tokens gives ``log P(word | prompt)``
  exactly (no top-k cut: ``logprobs=k`` on the first generated token only sees the word when it is in
  the top k, and only single-token words); the score is ``P(yes) / (P(yes) + P(no))``, which for
  single-token words is the softmax over the two tokens' logits.
* ``number`` -- one greedy generation of up to ``max_new_tokens`` tokens; the first number of its text,
  clipped to ``[score_min, score_max]`` (``score_min`` when there is none).

**Placement.** The judge is *colocated*: it lives in the worker process of the reward role, which the
trainer fuses with the actor's (`create_colocated_worker_cls`), next to the actor's own vLLM engine;
every rank holds a full judge engine (``tensor_parallel_size`` 1; in a world of more than one rank vLLM
reuses it through ``external_launcher``, as the rollout does) and scores its data-parallel chunk. On CUDA
with ``judge.free_cache_engine`` the engine is built with sleep mode and sleeps at level 1 (weights
copied to host memory, KV cache dropped -- its weights never come back from a sync, unlike the
rollout's) except while it scores. Only the single-rank CPU path is tested here: on CPU vLLM has no sleep
mode, and two sleep-mode engines in one process share vLLM's process-wide `CuMemAllocator`, so one's
sleep/wake may move the other's memory too -- that needs a check on a GPU. A ``split`` placement (the
judge on devices of its own, as `trainer.placement=split` gives the rollout) is not implemented: it
would need a judge pool of its own (`placement_pools` with a `reward_model` share of the GPUs, a
`RolloutWorker`-like standalone worker with no training state, without sleep), and the trainer sending it
the decoded texts (or token ids) instead of calling the colocated worker group.
"""

from __future__ import annotations

import logging
import time

import torch
from omegaconf import DictConfig, OmegaConf

from hflow.protocol import DataProto
from hflow.single_controller.base import Dispatch, register
from hflow.utils.device import is_cuda
from hflow.reward.judge import check_judge_config, parse_number, question_text, reference_text, render_judge_prompt, yes_no_probability
from hflow.workers.config import normalize_reward_model
from hflow.utils.torch_functional import last_valid_index, response_attention_mask
from hflow.workers.common import load_tokenizer
from hflow.workers.fsdp_workers import RewardModelWorker
from hflow.workers.rollout.config import engine_section

__all__ = ["GenerativeRewardModelWorker", "VLLMJudge"]

logger = logging.getLogger(__name__)



class VLLMJudge:
    """A judge model on its own in-process vLLM engine: `yes_no_scores` and `greedy_texts` on token-id
    prompts (already rendered with the judge's chat template). `judge` is `reward_model.judge`."""

    def __init__(self, model_path: str, judge: DictConfig, seed: int = 0) -> None:
        from transformers import AutoConfig

        from hflow.workers.rollout.vllm_rollout import new_engine, vLLMRollout

        self.judge = judge
        self.max_prompt_length = int(judge.max_prompt_length)
        self.sleep_enabled = is_cuda() and bool(judge.free_cache_engine)
        dtype = str(judge.dtype)
        config = engine_section(
            prompt_length=self.max_prompt_length + 8,  # + the verdict word's tokens (yes_no)
            response_length=max(int(judge.max_new_tokens), 1),
            dtype="float32" if dtype == "auto" and not is_cuda() else dtype,
            load_format="auto",  # the judge's own weights: no sync ever reaches this engine
            gpu_memory_utilization=float(judge.gpu_memory_utilization),
            free_cache_engine=bool(judge.free_cache_engine),
            tensor_model_parallel_size=1,
            seed=seed,
        )
        OmegaConf.update(config, "engine_kwargs.vllm", OmegaConf.to_container(judge.engine_kwargs), merge=False)
        kwargs = vLLMRollout._engine_kwargs(model_path, config, AutoConfig.from_pretrained(model_path), None)
        started = time.perf_counter()
        self.llm = new_engine(kwargs)
        logger.info("judge vLLM engine ready in %.1fs", time.perf_counter() - started)
        self.tokenizer = self.llm.get_tokenizer()
        self.sleep()

    def sleep(self) -> None:
        """Level 1: weights to host memory, KV cache dropped (the judge's weights are not re-synced);
        a no-op on CPU."""
        if self.sleep_enabled:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleep_enabled:
            self.llm.wake_up()

    def encode_chat(self, user_messages: list[str]) -> list[list[int]]:
        """Each message as the judge's one user turn with its generation prompt, cut from the left to
        `max_prompt_length` tokens."""
        out = []
        for message in user_messages:
            chat = [{"role": "user", "content": message}]
            if getattr(self.tokenizer, "chat_template", None):
                ids = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            else:
                ids = self.tokenizer.encode(message)
            out.append(ids[-self.max_prompt_length:])
        return out

    def word_ids(self, word: str) -> list[int]:
        ids = self.tokenizer.encode(word, add_special_tokens=False)
        if not ids:
            raise ValueError(f"reward_model.judge: the verdict word {word!r} encodes to no tokens")
        return ids

    @torch.no_grad()
    def yes_no_scores(self, prompts: list[list[int]]) -> list[float]:
        """P(yes) / (P(yes) + P(no)) per prompt, exact (see the module docstring)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        words = (self.word_ids(str(self.judge.yes_word)), self.word_ids(str(self.judge.no_word)))
        requests = [TokensPrompt(prompt_token_ids=p + w) for p in prompts for w in words]
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        log_probs = []
        for request, output in zip(requests, outputs):
            ids = request["prompt_token_ids"]
            word = words[len(log_probs) % 2]
            start = len(ids) - len(word)
            log_probs.append(sum(output.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))))
        return [yes_no_probability(log_probs[2 * i], log_probs[2 * i + 1]) for i in range(len(prompts))]

    @torch.no_grad()
    def greedy_texts(self, prompts: list[list[int]]) -> list[str]:
        """The judge's greedy reply to each prompt (up to `max_new_tokens` tokens, special tokens dropped)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=int(self.judge.max_new_tokens), temperature=0.0,
                                skip_special_tokens=True)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].text for o in outputs]

    def score(self, user_messages: list[str]) -> tuple[list[float], list[str] | None]:
        """Scores of the rendered user messages (and, for `number`, the judge's texts), woken for the call."""
        prompts = self.encode_chat(user_messages)
        self.wake_up()
        try:
            if str(self.judge.parser) == "yes_no":
                return self.yes_no_scores(prompts), None
            texts = self.greedy_texts(prompts)
            lo, hi = float(self.judge.score_min), float(self.judge.score_max)
            return [parse_number(t, lo, hi) for t in texts], texts
        finally:
            self.sleep()

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


class GenerativeRewardModelWorker(RewardModelWorker):
    """The reward role with a generative judge (`reward_model` subtree, `style=generative`):
    `compute_rm_score` like `RewardModelWorker`'s, scored by `VLLMJudge` (see the module docstring)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        config = normalize_reward_model(self.raw_config)
        check_judge_config(config)
        self.config = config
        self.init_distributed()
        model_cfg = config.model
        self.input_tokenizer = load_tokenizer(model_cfg.input_tokenizer or model_cfg.path, model_cfg.trust_remote_code)
        self.judge = VLLMJudge(model_cfg.path, config.judge, seed=self.rank)

    def user_messages(self, data: DataProto) -> list[str]:
        """The judge's user message for every sample of `data` (see the module docstring)."""
        responses = data.batch["responses"]
        width = responses.shape[1]
        mask = data.batch["attention_mask"]
        raw_prompts = data.non_tensor_batch.get("raw_prompt")
        entries = data.non_tensor_batch.get("reward_model")
        judge = self.config.judge
        messages = []
        for i in range(len(data)):
            response = self.input_tokenizer.decode(responses[i][mask[i, -width:].bool()], skip_special_tokens=True)
            raw = None if raw_prompts is None else raw_prompts[i]
            decoded = "" if raw is not None else self.input_tokenizer.decode(
                data.batch["input_ids"][i, :-width][mask[i, :-width].bool()], skip_special_tokens=True)
            messages.append(render_judge_prompt(
                judge.prompt_template, question_text(raw, decoded), response,
                None if entries is None else reference_text(entries[i]),
                str(judge.parser), float(judge.score_min), float(judge.score_max)))
        return messages

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        scores, _ = self.judge.score(self.user_messages(data)) if len(data) else ([], None)
        responses = data.batch["responses"]
        response_mask = response_attention_mask(data.batch["attention_mask"], responses)
        rm_scores = torch.zeros(responses.shape, dtype=torch.float32)
        has_response = response_mask.sum(-1) > 0
        last = last_valid_index(response_mask)
        rows = torch.arange(len(data))[has_response]
        rm_scores[rows, last[has_response]] = torch.tensor(scores, dtype=torch.float32)[has_response]
        return DataProto.from_dict({"rm_scores": rm_scores})
