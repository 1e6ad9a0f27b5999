"""Token ids of tool messages, as the chat template renders them after an assistant turn.

A trajectory is one list of ids that only grows (token in, token out): the prompt's ids, each assistant
turn's ids exactly as sampled, and each tool message's ids. The assistant ids are never rendered again,
so a tool message is encoded by itself: the template renders a fixed short conversation that ends with
an assistant message, then the same conversation plus the tool messages and the next generation
prompt; the tool ids are the encoding of the text between the end of the assistant message's stop token
and the end of the second rendering. That text carries whatever the template writes after a stop token
(ChatML's newline), the tool messages and the opening of the next assistant turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ToolMessageEncoder", "truncate_text"]

# A neutral conversation to render tool messages after; its own text never reaches a trajectory.
_ANCHOR = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]

TRUNCATE_SIDES = ("left", "right", "middle")


class ToolMessageEncoder:
    """`encode(messages)` -> the ids to append after a sampled assistant turn that ended with its stop token.

    `tools` (OpenAI function schemas) are passed to the template like the prompt's, for templates
    that render them. Fails at construction, naming the template problem, when the template does not
    end an assistant message with the tokenizer's EOS text (the point where sampled ids stop).
    """

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        anchor = self._render(_ANCHOR, add_generation_prompt=False)
        eos_text = tokenizer.eos_token
        end = anchor.rfind(eos_text) if eos_text else -1
        if end < 0:
            raise ValueError(
                f"the chat template does not end an assistant message with the EOS token {eos_text!r}; hflow "
                "cannot tell where a sampled turn stops in the template's text. Use a template whose assistant "
                "messages end with the tokenizer's eos_token, or set the tokenizer's eos_token to the turn end"
            )
        self._prefix = anchor[: end + len(eos_text)]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if self.tools:
            kwargs["tools"] = self.tools
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def text(self, messages: Sequence[dict]) -> str:
        """The template's text for `messages` (role "tool" each) after an assistant turn."""
        full = self._render([*_ANCHOR, *messages], add_generation_prompt=True)
        if not full.startswith(self._prefix):
            raise ValueError(
                "the chat template renders the conversation before the tool messages differently once they are "
                "added; hflow cannot append tool messages to a trajectory without re-rendering it"
            )
        return full[len(self._prefix):]

    def encode(self, messages: Sequence[dict]) -> list[int]:
        return list(self.tokenizer.encode(self.text(messages), add_special_tokens=False))

    def after_prompt(self, messages: Sequence[dict]) -> list[int]:
        """The ids that put `messages` (an environment's first observation) after a prompt that ends with the
        generation prompt: the EOS that closes that (empty) assistant turn, then `encode(messages)`. The
        prompt's ids stay as the dataset made them; the model sees an empty turn, then the messages."""
        eos = list(self.tokenizer.encode(self.tokenizer.eos_token, add_special_tokens=False))
        return eos + self.encode(messages)


def truncate_text(text: str, max_chars: int | None, side: str = "middle") -> str:
    """`text` cut to at most `max_chars` characters (None or <= 0: unchanged), keeping its `side`'s
    opposite: "left" drops the start, "right" the end, "middle" the middle (marked with "...")."""
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"tool_response_truncate_side={side!r}; choose one of {list(TRUNCATE_SIDES)}")
    if not max_chars or max_chars <= 0 or len(text) <= max_chars:
        return text
    if side == "left":
        return "..." + text[len(text) - max_chars:]
    if side == "right":
        return text[:max_chars] + "..."
    head = max_chars // 2
    return text[:head] + "..." + text[len(text) - (max_chars - head):]
