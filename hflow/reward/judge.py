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


def check_judge_config(config: Any) -> None:
    """`reward_model.style` and, for a generative judge, its parser and score range (preflight and the
    worker both apply it, so a wrong key stops the run before any model loads)."""
    from hflow.config_schema import check_choice, check_lower_upper

    check_choice(str(config.style), STYLES, "reward_model.style")
    if str(config.style) != "generative":
        return
    judge = config.judge
    check_choice(str(judge.parser), PARSERS, "reward_model.judge.parser")
    check_lower_upper(judge.score_min, judge.score_max, "reward_model.judge.score_min", "reward_model.judge.score_max")
