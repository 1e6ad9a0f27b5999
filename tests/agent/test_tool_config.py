"""Loading tools from YAML: both forms, the example file, and each mistake named by file, index and key."""

import asyncio
import os
import textwrap
from pathlib import Path

import pytest

from hflow.agent.parsers import ToolCall
from hflow.agent.tool_config import builtin_tools, load_tools, tool_schemas
from hflow.agent.tools import CalculatorTool, FunctionTool, run_tool_call
from hflow.utils.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent" / "tools_example.yaml"

FUNCTIONS = '''
import asyncio

def word_count(text):
    return len(text.split())

async def echo(text, suffix="!"):
    await asyncio.sleep(0)
    return text + suffix

def needs_secret(text, secret):
    return text

def positional_only(text, /):
    return text

def any_kwargs(**kwargs):
    return sorted(kwargs)

NOT_A_FUNCTION = 3
'''

# Indented to follow an entry of the YAML texts below (whose entries start at column 10).
WORD_COUNT_SCHEMA = """
            tool_schema:
              type: function
              function:
                name: word_count
                description: Count words.
                parameters: {type: object, properties: {text: {type: string}}, required: [text]}
"""


def write(folder, text, name="tools.yaml"):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "fns").mkdir()
    (tmp_path / "fns" / "my_fns.py").write_text(FUNCTIONS)
    return tmp_path


def test_both_forms_in_file_order(folder):
    path = write(folder, """
        tools:
          - class_name: hflow.agent.tools.CalculatorTool
            config: {}
            tool_schema:
              type: function
              function:
                name: calc
                description: Exact arithmetic.
                parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
          - function: fns/my_fns.py:word_count
    """ + WORD_COUNT_SCHEMA + """
          - class_name: calculator
          - function: fns/my_fns.py:echo
            config: {note: 1}
            tool_schema: {function: {name: echo, parameters: {type: object, properties: {text: {type: string}}}}}
    """)
    tools = load_tools(path)
    assert list(tools) == ["calc", "word_count", "calculator", "echo"]
    assert isinstance(tools["calc"], CalculatorTool) and isinstance(tools["calculator"], CalculatorTool)
    assert isinstance(tools["word_count"], FunctionTool) and tools["echo"].config == {"note": 1}
    assert tools["calculator"].tool_schema == CalculatorTool.default_schema()
    schemas = tool_schemas(tools)
    assert [s["function"]["name"] for s in schemas] == list(tools)
    assert all(s["type"] == "function" for s in schemas)

    async def calls():
        return [await run_tool_call(tools, call) for call in [
            ToolCall("calc", {"expression": "2 ^ 10"}), ToolCall("word_count", {"text": "a b c"}),
            ToolCall("echo", {"text": "hi"})]]

    assert [o.text for o in asyncio.run(calls())] == ["1024", "3", "hi!"]


def test_the_example_file_loads_and_runs():
    tools = load_tools(str(EXAMPLE))
    assert list(tools) == ["calculator", "word_count", "letter_count"]

    async def calls():
        return [await run_tool_call(tools, call) for call in [
            ToolCall("letter_count", {"word": "strawberry", "letter": "r"}),
            ToolCall("word_count", {"text": "the quick brown fox"})]]

    assert [o.text for o in asyncio.run(calls())] == ["3", "4"]


def test_builtin_tools():
    tools = builtin_tools(["calculator"])
    assert list(tools) == ["calculator"] and list(builtin_tools()) == ["calculator"]
    with pytest.raises(ConfigError, match="no built-in tool named 'search'; the built-in tools are calculator, python"):
        builtin_tools(["search"])


def expect_error(folder, text, *fragments):
    path = write(folder, text)
    with pytest.raises(ConfigError) as info:
        load_tools(path)
    message = str(info.value)
    for fragment in (path, *fragments):
        assert fragment in message, (fragment, message)
    return message


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="nope.yaml: no such file"):
        load_tools(missing)


@pytest.mark.parametrize("text, fragment", [
    ("tools: {class_name: calculator}\n", "'tools' must be a non-empty list"),
    ("- class_name: calculator\n", "'tools' must be a non-empty list"),
    ("tools: []\n", "'tools' must be a non-empty list"),
    ("tools: [\n", "not valid YAML"),
])
def test_not_a_list(folder, text, fragment):
    expect_error(folder, text, fragment)


def test_both_or_neither_of_class_name_and_function(folder):
    expect_error(folder, """
        tools:
          - class_name: calculator
          - class_name: calculator
            function: fns/my_fns.py:word_count
    """, "tools[1]", "exactly one of class_name", "function")
    expect_error(folder, """
        tools:
          - config: {}
    """, "tools[0]", "exactly one of class_name")


def test_unknown_key_and_bad_config(folder):
    expect_error(folder, """
        tools:
          - class_name: calculator
            tool_schem: {}
    """, "tools[0]", "unknown key(s) 'tool_schem'")
    expect_error(folder, """
        tools:
          - class_name: calculator
            config: [1]
    """, "tools[0].config must be a mapping")


@pytest.mark.parametrize("class_name, fragment", [
    ("no_such_package.tools.Tool", "tools[0].class_name='no_such_package.tools.Tool': importing no_such_package.tools failed"),
    ("hflow.agent.tools.NoSuchTool", "module hflow.agent.tools has no 'NoSuchTool'"),
    ("collections.OrderedDict", "is not a subclass of hflow.agent.tools.BaseTool"),
    ("calculatorr", "tools[0].class_name='calculatorr': not a built-in tool"),
    ("hflow.agent.tools.FunctionTool", "function: file.py:name"),
])
def test_import_failures(folder, class_name, fragment):
    expect_error(folder, f"""
        tools:
          - class_name: {class_name}
            tool_schema: {{function: {{name: t}}}}
    """, fragment)


def test_class_without_default_schema_needs_one(folder):
    expect_error(folder, """
        tools:
          - class_name: tests.agent.test_tools.Recorder
    """, "tools[0].tool_schema is missing")


def test_function_file_missing_or_lacking_the_name(folder):
    expect_error(folder, """
        tools:
          - function: fns/nope.py:word_count
    """ + WORD_COUNT_SCHEMA, "tools[0].function='fns/nope.py:word_count'", "does not exist",
                 os.path.join(str(folder), "fns", "nope.py"))
    expect_error(folder, """
        tools:
          - function: fns/my_fns.py:word_counter
    """ + WORD_COUNT_SCHEMA, "tools[0].function", "defines no such function", "word_count")
    expect_error(folder, """
        tools:
          - function: fns/my_fns.py:NOT_A_FUNCTION
    """ + WORD_COUNT_SCHEMA, "tools[0].function", "not a function")
    expect_error(folder, """
        tools:
          - function: fns/my_fns.py
    """ + WORD_COUNT_SCHEMA, "tools[0].function must be 'path/to/file.py:function_name'")


def test_a_missing_function_names_the_key_the_tool_yaml_has(folder):
    """Issue 39: the error named tools[0].function.name, a key the tool YAML does not have; the name is written
    after the ':' of tools[0].function."""
    for spec in ("fns/my_fns.py:word_counter", "fns/my_fns.py:NOT_A_FUNCTION"):
        with pytest.raises(ConfigError) as err:
            load_tools(write(folder, """
        tools:
          - function: %s
    """ % spec + WORD_COUNT_SCHEMA))
        message = str(err.value)
        assert "tools[0].function: " in message and "after the ':' of tools[0].function" in message, message
        assert "function.name" not in message and "function.path" not in message, message


def test_function_file_that_fails_to_import(folder):
    (folder / "fns" / "broken.py").write_text("x = 1\nraise RuntimeError('boom')\n")
    expect_error(folder, """
        tools:
          - function: fns/broken.py:word_count
    """ + WORD_COUNT_SCHEMA, "tools[0].function", "importing the file failed at line 2 with RuntimeError: boom")


def test_function_tool_needs_a_schema(folder):
    expect_error(folder, """
        tools:
          - function: fns/my_fns.py:word_count
    """, "tools[0].tool_schema is missing")


@pytest.mark.parametrize("function, properties, required, fragment", [
    # A schema parameter the function does not take.
    ("word_count", "{text: {type: string}, lang: {type: string}}", "[text]",
     "the schema's parameter(s) 'lang' are not keyword arguments of word_count(text)"),
    # A required function parameter the schema does not give.
    ("needs_secret", "{text: {type: string}}", "[text]", "needs_secret(text, secret) requires 'secret'"),
    # Positional-only: cannot be passed by keyword.
    ("positional_only", "{text: {type: string}}", "[text]", "'text' are not keyword arguments"),
])
def test_function_signature_must_fit_the_schema(folder, function, properties, required, fragment):
    message = expect_error(folder, f"""
        tools:
          - class_name: calculator
          - function: fns/my_fns.py:{function}
            tool_schema:
              function:
                name: t
                parameters: {{type: object, properties: {properties}, required: {required}}}
    """, "tools[1]", fragment)
    assert "tool_schema.function.parameters.properties" in message


def test_signature_that_fits(folder):
    path = write(folder, """
        tools:
          - function: fns/my_fns.py:any_kwargs
            tool_schema: {function: {name: a, parameters: {type: object, properties: {q: {type: string}}}}}
          - function: fns/my_fns.py:echo
            tool_schema: {function: {name: e, parameters: {type: object, properties: {text: {type: string}}}}}
    """)
    assert list(load_tools(path)) == ["a", "e"]


def test_duplicate_names(folder):
    expect_error(folder, """
        tools:
          - class_name: calculator
          - function: fns/my_fns.py:word_count
    """ + WORD_COUNT_SCHEMA + """
          - class_name: hflow.agent.tools.CalculatorTool
    """, "tools[2].tool_schema.function.name='calculator' is also the name of tools[0]")


@pytest.mark.parametrize("schema, fragment", [
    ("{type: function}", "tools[0].tool_schema must be {type: function, function:"),
    ("{function: {description: no name}}", "tools[0].tool_schema.function.name is missing"),
    ("{type: retrieval, function: {name: t}}", "tools[0].tool_schema.type must be 'function'"),
    ("{function: {name: t, parameters: [1]}}", "tools[0].tool_schema.function.parameters must be a JSON schema"),
])
def test_bad_schemas(folder, schema, fragment):
    expect_error(folder, f"""
        tools:
          - class_name: calculator
            tool_schema: {schema}
    """, fragment)


def test_a_class_that_fails_to_build(folder):
    expect_error(folder, """
        tools:
          - class_name: tests.agent.test_tool_config.Picky
            config: {level: 11}
            tool_schema: {function: {name: picky}}
    """, "tools[0]", "ValueError: level must be at most 10", "tools[0].config")


class Picky(CalculatorTool):
    def __init__(self, config, tool_schema):
        if config.get("level", 0) > 10:
            raise ValueError("level must be at most 10")
        super().__init__(config, tool_schema)
