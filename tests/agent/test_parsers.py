"""Tool-call parsers: the hermes format, malformed blocks named, and registering a format."""

import json

import pytest

from hflow.agent.parsers import ParsedTurn, ToolCall, ToolCallParser, get_parser, register_parser


def block(payload, pad="\n"):
    body = payload if isinstance(payload, str) else json.dumps(payload)
    return f"<tool_call>{pad}{body}{pad}</tool_call>"


@pytest.fixture
def hermes():
    return get_parser("hermes")


def test_single_call_and_content(hermes):
    text = "I'll compute it.\n" + block({"name": "calculator", "arguments": {"expression": "37 * 86"}}) + "<|im_end|>"
    turn = hermes.parse(text)
    assert turn == ParsedTurn(content="I'll compute it.\n<|im_end|>",
                              calls=[ToolCall("calculator", {"expression": "37 * 86"})], malformed=[])


def test_several_calls_in_order_and_content_between(hermes):
    text = ("First " + block({"name": "a", "arguments": {"x": 1}}, pad="")
            + " then " + block({"name": "b", "arguments": {"y": [1, 2]}}, pad="\n\n  ") + "\n")
    turn = hermes.parse(text)
    assert turn.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]})]
    assert turn.content == "First  then"
    assert turn.malformed == []


def test_no_call(hermes):
    assert hermes.parse("  The answer is 42.  ") == ParsedTurn("The answer is 42.", [], [])


def test_arguments_as_json_string_and_missing_arguments(hermes):
    text = block({"name": "a", "arguments": json.dumps({"q": "x"})}) + block({"name": "b"}) + block(
        {"name": "c", "arguments": None})
    assert hermes.parse(text).calls == [ToolCall("a", {"q": "x"}), ToolCall("b", {}), ToolCall("c", {})]


@pytest.mark.parametrize("body, names", [
    ('{"name": "a", "arguments": {"x": 1}', "invalid JSON"),
    ("{bad}", "invalid JSON"),
    ("", "empty tool call"),
    ('{"arguments": {"x": 1}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', '"name" that is not a non-empty string'),
    ('{"name": 3}', '"name" that is not a non-empty string'),
    ('[{"name": "a"}]', "not an array"),
    ('{"name": "a", "arguments": [1, 2]}', '"arguments" must be a JSON object, not an array'),
    ('{"name": "a", "arguments": "{not json"}', '"arguments" is a string that is not JSON'),
    ('{"name": "a", "arguments": "[1]"}', '"arguments" must be a JSON object, not an array'),
])
def test_malformed_blocks_are_named(hermes, body, names):
    good = block({"name": "ok", "arguments": {}})
    turn = hermes.parse("before " + block(body) + good)
    assert turn.calls == [ToolCall("ok", {})]
    assert len(turn.malformed) == 1 and names in turn.malformed[0], turn.malformed
    assert turn.content == "before"


def test_unclosed_tag(hermes):
    turn = hermes.parse('Let me see <tool_call>\n{"name": "a", "arguments": {}}<|im_end|>')
    assert turn.calls == []
    assert len(turn.malformed) == 1 and "unclosed <tool_call>" in turn.malformed[0]
    assert turn.content == "Let me see"


def test_unclosed_tag_before_a_good_block(hermes):
    turn = hermes.parse('<tool_call>{"name": "a"}\n' + block({"name": "b", "arguments": {}}))
    assert turn.calls == [ToolCall("b", {})]
    assert len(turn.malformed) == 1 and "unclosed" in turn.malformed[0] and '"a"' in turn.malformed[0]


def test_long_bad_block_is_quoted_short(hermes):
    turn = hermes.parse(block("{" + "x" * 5000))
    assert len(turn.malformed[0]) < 400


def test_unknown_format_lists_registered():
    with pytest.raises(ValueError, match="registered formats: .*hermes"):
        get_parser("no-such-format")


class _BracketParser(ToolCallParser):
    """[[name: json arguments]] -- a made-up format."""

    def parse(self, text):
        import re

        calls = [ToolCall(m[1], json.loads(m[2])) for m in re.finditer(r"\[\[(\w+): (.*?)\]\]", text)]
        return ParsedTurn(re.sub(r"\[\[.*?\]\]", "", text).strip(), calls, [])


def test_register_a_custom_parser():
    register_parser("test-brackets")(_BracketParser)
    turn = get_parser("test-brackets").parse('ok [[calc: {"expression": "1+1"}]]')
    assert turn == ParsedTurn("ok", [ToolCall("calc", {"expression": "1+1"})], [])
    register_parser("test-brackets")(_BracketParser)  # registering the same class again is harmless
    with pytest.raises(ValueError, match="already registered"):
        register_parser("hermes")(_BracketParser)
    with pytest.raises(TypeError):
        register_parser("test-not-a-parser")(dict)
