"""Tool-call parsers: find the tool calls in an assistant turn's text.

A parser turns the decoded assistant turn (special tokens kept) into a `ParsedTurn`: the text without
the call blocks, the well-formed calls in order, and one message per block that could not be read.
The loop sends those messages back to the model as tool errors, so each names what is wrong.

Formats are pluggable: decorate a `ToolCallParser` subclass with ``@register_parser("name")`` and
choose it by that name (`get_parser`). Built in: ``hermes``, the Qwen2.5 / Hermes convention::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37 * 86"}}
    </tool_call>
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["HermesParser", "ParsedTurn", "ToolCall", "ToolCallParser", "call_from_json", "get_parser", "register_parser"]

# How much of a bad block a malformed-call message quotes.
_QUOTE_CHARS = 200


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn, read: its text without the call blocks (stripped), its calls, its bad blocks."""

    content: str
    calls: list[ToolCall]
    malformed: list[str]


class ToolCallParser(ABC):
    """Reads the tool calls of one format out of an assistant turn's text."""

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """The turn's content, its well-formed calls in order, and one message per malformed block."""


_PARSERS: dict[str, type[ToolCallParser]] = {}


def register_parser(name: str) -> Callable[[type[ToolCallParser]], type[ToolCallParser]]:
    """Class decorator: make a `ToolCallParser` subclass available as `get_parser(name)`."""

    def register(cls: type[ToolCallParser]) -> type[ToolCallParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
            raise TypeError(f"register_parser({name!r}) decorates ToolCallParser subclasses, not {cls!r}")
        known = _PARSERS.get(name)
        # The same class defined again (a module reloaded) replaces itself; another class is a clash.
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"a tool-call parser named {name!r} is already registered ({known.__qualname__})")
        _PARSERS[name] = cls
        return cls

    return register


def get_parser(name: str) -> ToolCallParser:
    """A new parser of the format registered as `name`; ValueError lists the registered names."""
    cls = _PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call format {name!r}; registered formats: {', '.join(sorted(_PARSERS))}")
    return cls()


def call_from_json(body: str) -> ToolCall | str:
    """A `ToolCall` from the JSON text ``{"name": ..., "arguments": {...}}``, or the message saying what is wrong.

    "arguments" may also be a JSON string holding the object (some models encode it twice); missing or
    null, it is ``{}``. Other keys are ignored. Useful to parsers of other formats with JSON bodies.
    """
    body = body.strip()
    if not body:
        return "empty tool call: expected a JSON object with \"name\" and \"arguments\""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"invalid JSON in tool call ({exc.msg} at line {exc.lineno} column {exc.colno}): {_quote(body)}"
    if not isinstance(data, dict):
        return f"a tool call must be a JSON object with \"name\" and \"arguments\", not {json_type(data)}: {_quote(body)}"
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        what = "has no \"name\"" if name is None else f"has a \"name\" that is not a non-empty string ({name!r})"
        return f"tool call {what}: {_quote(body)}"
    arguments = data.get("arguments")
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return f"tool call {name!r}: \"arguments\" is a string that is not JSON ({exc.msg}): {_quote(body)}"
    if not isinstance(arguments, dict):
        return f"tool call {name!r}: \"arguments\" must be a JSON object, not {json_type(arguments)}: {_quote(body)}"
    return ToolCall(name=name.strip(), arguments=arguments)


@register_parser("hermes")
class HermesParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5, Hermes); several per turn, whitespace optional."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        content: list[str] = []
        calls: list[ToolCall] = []
        malformed: list[str] = []
        position = 0
        while (start := text.find(self.open_tag, position)) != -1:
            content.append(text[position:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            reopened = text.find(self.open_tag, body_start)
            if end == -1 or reopened != -1 and reopened < end:
                # Unclosed: the block runs to the next opening tag, or to the end of the turn.
                stop = len(text) if end == -1 else reopened
                malformed.append(
                    f"unclosed {self.open_tag}: no {self.close_tag} follows it: {_quote(text[start:stop].strip())}")
                position = stop
                continue
            parsed = call_from_json(text[body_start:end])
            (calls if isinstance(parsed, ToolCall) else malformed).append(parsed)
            position = end + len(self.close_tag)
        content.append(text[position:])
        return ParsedTurn(content="".join(content).strip(), calls=calls, malformed=malformed)


def _quote(text: str) -> str:
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...")


def json_type(value: Any) -> str:
    """What a decoded JSON value is, in words ("an array", "a string", ...)."""
    names = {list: "an array", str: "a string", bool: "a boolean", int: "an integer", float: "a number",
             type(None): "null", dict: "an object"}
    return names.get(type(value), type(value).__name__)
