"""A generative judge's prompt and parsers (`reward_model.style=generative`), free of any engine.

The judge is a chat model asked, in one user message, whether a response answers a question; the
message comes from `reward_model.judge.prompt_template` with the placeholders ``{question}``,
``{response}`` and ``{reference}`` (the row's ``reward_model.ground_truth``), or from a built-in
template (`default_template`). Its answer becomes a score by one of two parsers:

* ``yes_no``: ``P(yes) / (P(yes) + P(no))`` where ``P(w)`` is the judge's probability of the word ``w``
  as the whole beginning of its reply, i.e. the product of the word's token probabilities after the
  prompt (`yes_no_probability` takes the two summed token log-probs). For single-token words this is
  the softmax over the two tokens' next-token logits.
* ``number``: the first number of the judge's greedy text, clipped to ``[score_min, score_max]``; a reply
  without a number scores ``score_min`` (`parse_number`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "PARSERS",
    "check_sleep_mode_engines",
    "judge_has_own_process",
    "default_template",
    "parse_number",
    "question_text",
    "reference_text",
    "render_judge_prompt",
    "yes_no_probability",
]

PARSERS = ("yes_no", "number")
STYLES = ("discriminative", "generative")  # reward_model.style

_ASK_YES_NO = "Is the response correct? Answer yes or no."
_ASK_NUMBER = "Rate the response from {score_min:g} to {score_max:g}. Answer with the number only."
_WITH_REFERENCE = "Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
_WITHOUT_REFERENCE = "Question: {question}\nResponse: {response}\n"
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def default_template(parser: str, with_reference: bool, score_min: float = 0.0, score_max: float = 10.0) -> str:
    """The built-in user message: question, reference answer (when the row has one), response, then the
    request -- yes or no for `yes_no`, a number in the range for `number`."""
    body = _WITH_REFERENCE if with_reference else _WITHOUT_REFERENCE
    if parser == "yes_no":
        return body + _ASK_YES_NO
    if parser == "number":
        return body + _ASK_NUMBER.format(score_min=score_min, score_max=score_max)
    raise ValueError(f"reward_model.judge.parser={parser!r} is not one of {list(PARSERS)}")


def render_judge_prompt(template: str | None, question: str, response: str, reference: str | None,
                        parser: str = "yes_no", score_min: float = 0.0, score_max: float = 10.0) -> str:
    """The judge's user message. A user `template` that names ``{reference}`` needs a reference answer;
    the built-in one (`template=None`) leaves the reference line out when there is none."""
    if template is None:
        template = default_template(parser, reference is not None, score_min, score_max)
    elif reference is None and "{reference}" in template:
        raise ValueError("reward_model.judge.prompt_template uses {reference} but the row has no "
                         "reward_model.ground_truth")
    return template.format(question=question, response=response, reference="" if reference is None else reference)


def parse_number(text: str, score_min: float, score_max: float) -> float:
    """The first number in `text` (sign, decimals and exponent included), clipped to the range;
    `score_min` when there is none (or it is not finite)."""
    match = _NUMBER.search(text)
    if match is None:
        return float(score_min)
    value = float(match.group())
    if not math.isfinite(value):
        return float(score_min)
    return float(min(max(value, score_min), score_max))


def yes_no_probability(logp_yes: float, logp_no: float) -> float:
    """``P(yes) / (P(yes) + P(no))`` from the two words' log-probabilities, computed stably
    (a sigmoid of their difference)."""
    diff = logp_yes - logp_no
    if diff >= 0:
        return 1.0 / (1.0 + math.exp(-diff))
    e = math.exp(diff)
    return e / (1.0 + e)


def question_text(raw_prompt: Sequence[Mapping[str, Any]] | None, decoded_prompt: str) -> str:
    """The question a judge sees: the last user message of the row's chat, else the decoded prompt."""
    if raw_prompt is not None:
        users = [m["content"] for m in raw_prompt if m.get("role") == "user"]
        if users:
            return str(users[-1])
    return decoded_prompt


def reference_text(reward_model_entry: Any) -> str | None:
    """The row's ``reward_model.ground_truth`` as text, or None."""
    if isinstance(reward_model_entry, Mapping):
        truth = reward_model_entry.get("ground_truth")
        return None if truth is None else str(truth)
    return None


def check_judge_config(config: Any, run_config: Any = None) -> None:
    """`reward_model.style` and, for a generative judge, its parser and score range (preflight and the
    worker both apply it, so a wrong key stops the run before any model loads); given the whole
    `run_config` (preflight), also the process the judge's engine would share (`check_sleep_mode_engines`)."""
    from hflow.config_schema import check_choice, check_lower_upper

    check_choice(str(config.style), STYLES, "reward_model.style")
    if str(config.style) != "generative":
        return
    judge = config.judge
    check_choice(str(judge.parser), PARSERS, "reward_model.judge.parser")
    check_lower_upper(judge.score_min, judge.score_max, "reward_model.judge.score_min", "reward_model.judge.score_max")
    if run_config is not None:
        check_sleep_mode_engines(run_config)


def judge_has_own_process(config: Any) -> bool:
    """Whether the generative judge runs in worker processes of its own: with `trainer.backend=ray` it does,
    one on each device of the training pool, beside (not inside) the process of the actor and its rollout
    engine, since vLLM's sleep mode serves one engine per process; `local` has the driver's process only."""
    rm = config.reward_model
    return bool(rm.enable) and str(rm.style) == "generative" and str(config.trainer.backend) == "ray"


def check_sleep_mode_engines(config: Any) -> None:
    """No process may hold two sleep-mode vLLM engines. Sleep mode (CUDA, `free_cache_engine`) allocates an
    engine's weights and KV cache through vLLM's process-wide CuMem allocator, which serves one engine per
    process: vLLM's GPU worker asserts it when a second engine loads its weights. Only the local backend
    puts the rollout's engine and the judge's in one process (on Ray the judge has its own: `judge_has_own_process`);
    on CPU there is no sleep mode, and two engines share a process as any two objects do."""
    from hflow.config_schema import ConfigError
    from hflow.utils.device import is_cuda

    if not is_cuda() or judge_has_own_process(config):
        return
    rollout, rm = config.actor_rollout_ref.rollout, config.reward_model
    engines = []
    if rollout.name == "vllm" and rollout.free_cache_engine and config.trainer.placement == "colocate":
        engines.append("the rollout's (actor_rollout_ref.rollout.name=vllm, "
                       "actor_rollout_ref.rollout.free_cache_engine=true)")
    if rm.enable and str(rm.style) == "generative" and rm.judge.free_cache_engine:
        engines.append("the judge's (reward_model.style=generative, reward_model.judge.free_cache_engine=true)")
    if len(engines) > 1:
        raise ConfigError(
            f"trainer.backend={config.trainer.backend} puts two sleep-mode vLLM engines in one process: "
            f"{' and '.join(engines)}. vLLM's sleep mode serves one engine per process. Set trainer.backend=ray "
            "(the judge then runs in a process of its own on the same devices), or "
            "reward_model.judge.free_cache_engine=false (the judge keeps its memory between uses), or "
            "actor_rollout_ref.rollout.free_cache_engine=false")
