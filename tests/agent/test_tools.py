"""Tools and run_tool_call: every failure becomes an 'Error:' outcome of the right kind, never a raise."""

import asyncio
import time

import pytest

from hflow.agent.parsers import ToolCall
from hflow.agent.tools import (
    BaseTool,
    CalculatorTool,
    FunctionTool,
    ToolOutcome,
    malformed_outcome,
    run_tool_call,
    validate_arguments,
)

pytestmark = pytest.mark.alone  # deadlines and concurrency measured in wall time


def schema(name, properties=None, required=None, **extra):
    parameters = {"type": "object", "properties": properties or {}, "required": required or [], **extra}
    return {"type": "function", "function": {"name": name, "description": name, "parameters": parameters}}


def run(coro):
    return asyncio.run(coro)


class Recorder(BaseTool):
    """Records the calls it gets; `behaviour` decides what execute does."""

    def __init__(self, behaviour="ok", name="rec"):
        super().__init__({}, schema(name, {"x": {"type": "integer"}}))
        self.behaviour = behaviour
        self.events = []
        self.let_go = False  # ends "ignore-cancel"

    async def create(self, instance_id=None, **kwargs):
        instance_id = await super().create(instance_id, **kwargs)
        self.events.append(("create", kwargs))
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        self.events.append(("execute", parameters, kwargs, self.instances[instance_id]))
        if self.behaviour == "raise":
            raise KeyError("no such record")
        if self.behaviour == "hang":
            await asyncio.sleep(3)
        if self.behaviour == "ignore-cancel":
            give_up = time.monotonic() + 3  # so that a broken timeout fails the test instead of hanging it
            while not self.let_go and time.monotonic() < give_up:
                try:
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    continue
        return f"x={parameters.get('x')}", 0.5, {"calls": 1}

    async def release(self, instance_id, **kwargs):
        self.events.append(("release",))
        await super().release(instance_id, **kwargs)


def test_calculator_tool():
    tools = {"calculator": CalculatorTool()}
    outcome = run(run_tool_call(tools, ToolCall("calculator", {"expression": "37 * 86"})))
    assert (outcome.text, outcome.error) == ("3182", None)
    outcome = run(run_tool_call(tools, ToolCall("calculator", {"expression": "1/0"})))
    assert (outcome.text, outcome.error) == ("Error: division by zero", "bad_arguments")
    outcome = run(run_tool_call(tools, ToolCall("calculator", {"expression": "__import__('os')"})))
    assert outcome.text.startswith("Error: function calls are not allowed") and outcome.error == "bad_arguments"


def word_count(text: str) -> int:
    return len(text.split())


async def shout(text: str) -> str:
    await asyncio.sleep(0)
    return text.upper()


def test_function_tool_sync_and_async():
    tools = {"word_count": FunctionTool({}, schema("word_count", {"text": {"type": "string"}}, ["text"]), word_count),
             "shout": FunctionTool({}, schema("shout", {"text": {"type": "string"}}, ["text"]), shout)}
    outcome = run(run_tool_call(tools, ToolCall("word_count", {"text": "one two three"})))
    assert (outcome.text, outcome.error) == ("3", None)  # a non-str result is sent as JSON
    outcome = run(run_tool_call(tools, ToolCall("shout", {"text": "hi"})))
    assert (outcome.text, outcome.error) == ("HI", None)


def test_sync_function_runs_off_the_event_loop():
    threads = []

    def where(x: int) -> dict:
        import threading

        threads.append(threading.current_thread())
        return {"x": x}

    outcome = run(run_tool_call({"where": FunctionTool({}, schema("where"), where)}, ToolCall("where", {"x": 2})))
    assert outcome.text == '{"x": 2}'
    import threading

    assert threads and threads[0] is not threading.main_thread()


def test_unknown_tool_lists_the_available_ones():
    tools = {"calculator": CalculatorTool(), "rec": Recorder()}
    outcome = run(run_tool_call(tools, ToolCall("search", {"q": "x"})))
    assert outcome.error == "unknown_tool"
    assert outcome.text == "Error: unknown tool 'search'; the available tools are: calculator, rec"


def test_bad_arguments_are_named_and_the_tool_is_not_run():
    tool = Recorder()
    outcome = run(run_tool_call({"rec": tool}, ToolCall("rec", {"x": "three"})))
    assert outcome.error == "bad_arguments"
    assert outcome.text.startswith("Error: bad arguments for rec:") and "'x' must be integer, not a string" in outcome.text
    assert tool.events == []
    outcome = run(run_tool_call({"calculator": CalculatorTool()}, ToolCall("calculator", {})))
    assert outcome.error == "bad_arguments" and "missing required argument 'expression'" in outcome.text


def test_a_tool_that_raises():
    tool = Recorder("raise")
    outcome = run(run_tool_call({"rec": tool}, ToolCall("rec", {"x": 1})))
    assert outcome.error == "raised"
    assert outcome.text == "Error: KeyError: 'no such record'"
    assert "Traceback" not in outcome.text and "hflow" not in outcome.text
    assert tool.events[-1] == ("release",)  # released, although execute raised


@pytest.mark.parametrize("behaviour", ["hang", "ignore-cancel"])
def test_a_tool_past_its_deadline(behaviour):
    tool = Recorder(behaviour)

    async def main():
        start = time.perf_counter()
        outcome = await run_tool_call({"rec": tool}, ToolCall("rec", {"x": 1}), timeout_s=0.3)
        elapsed = time.perf_counter() - start
        tool.let_go = True  # so that asyncio.run can end the abandoned call
        return outcome, elapsed

    outcome, elapsed = run(main())
    assert outcome.error == "timeout" and outcome.text == "Error: the call to rec timed out after 0.3 s"
    # A tool that swallows its cancellation is left behind after a short grace, not waited on.
    assert 0.3 <= elapsed < (0.8 if behaviour == "hang" else 2.0)
    if behaviour == "hang":
        assert tool.events[-1] == ("release",)  # the cancelled call still released its instance


def test_a_sync_function_past_its_deadline():
    def slow() -> str:
        time.sleep(1)
        return "late"

    start = time.perf_counter()
    outcome = run(run_tool_call({"slow": FunctionTool({}, schema("slow"), slow)}, ToolCall("slow", {}), timeout_s=0.2))
    assert outcome.error == "timeout" and time.perf_counter() - start < 0.6


def test_release_is_called_after_success_and_instances_are_freed():
    tool = Recorder()
    outcome = run(run_tool_call({"rec": tool}, ToolCall("rec", {"x": 7})))
    assert (outcome.text, outcome.error, outcome.reward, outcome.metrics) == ("x=7", None, 0.5, {"calls": 1})
    assert [event[0] for event in tool.events] == ["create", "execute", "release"]
    assert tool.instances == {}


def test_tools_kwargs_reach_create_and_execute():
    tool = Recorder()
    row = {"rec": {"create_kwargs": {"ground_truth": "42"}, "execute_kwargs": {"mode": "strict"}},
           "other": {"create_kwargs": {"nope": 1}}}
    run(run_tool_call({"rec": tool}, ToolCall("rec", {"x": 1}), tools_kwargs=row))
    assert tool.events[0] == ("create", {"ground_truth": "42"})
    assert tool.events[1] == ("execute", {"x": 1}, {"mode": "strict"}, {"ground_truth": "42"})


def test_tools_kwargs_reach_a_function_and_override_the_model():
    def check(answer: str, ground_truth: str = "", mode: str = "") -> str:
        return f"{answer == ground_truth} {mode}"

    tool = FunctionTool({}, schema("check", {"answer": {"type": "string"}}, ["answer"]), check)
    row = {"check": {"create_kwargs": {"ground_truth": "42"}, "execute_kwargs": {"mode": "m"}}}
    outcome = run(run_tool_call({"check": tool}, ToolCall("check", {"answer": "42"}), tools_kwargs=row))
    assert outcome.text == "True m"
    cheat = ToolCall("check", {"answer": "1", "ground_truth": "1"})
    assert run(run_tool_call({"check": tool}, cheat, tools_kwargs=row)).text == "False m"


def test_a_bad_tools_kwargs_row_is_an_outcome_not_a_raise():
    outcome = run(run_tool_call({"rec": Recorder()}, ToolCall("rec", {"x": 1}), tools_kwargs={"rec": "oops"}))
    assert outcome.error == "raised" and outcome.text.startswith("Error: AttributeError")


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_calls_run_concurrently(kind):
    async def nap_async(i: int) -> str:
        await asyncio.sleep(0.2)
        return str(i)

    def nap_sync(i: int) -> str:
        time.sleep(0.2)
        return str(i)

    fn = nap_async if kind == "async" else nap_sync
    tools = {"nap": FunctionTool({}, schema("nap", {"i": {"type": "integer"}}, ["i"]), fn)}

    async def main():
        return await asyncio.gather(*(run_tool_call(tools, ToolCall("nap", {"i": i})) for i in range(20)))

    start = time.perf_counter()
    outcomes = run(main())
    elapsed = time.perf_counter() - start
    assert [o.text for o in outcomes] == [str(i) for i in range(20)]
    assert 0.2 <= elapsed < 0.6, elapsed


def test_cancelling_the_caller_propagates_and_cancels_the_call():
    tool = Recorder("hang")

    async def main():
        task = asyncio.ensure_future(run_tool_call({"rec": tool}, ToolCall("rec", {"x": 1})))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)

    run(main())
    assert tool.events[-1] == ("release",)


def test_execute_returning_the_wrong_shape_is_raised():
    class Bad(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return 42

    outcome = run(run_tool_call({"bad": Bad({}, schema("bad"))}, ToolCall("bad", {})))
    assert outcome.error == "raised" and "not a tuple (text, reward, metrics)" in outcome.text


def test_malformed_outcome():
    assert malformed_outcome("invalid JSON in tool call") == ToolOutcome(
        "Error: invalid JSON in tool call", "malformed", 0.0)


def test_validate_arguments():
    s = schema("t", {
        "s": {"type": "string", "enum": ["a", "b"]},
        "n": {"type": "number"},
        "i": {"type": "integer"},
        "b": {"type": "boolean"},
        "l": {"type": "array", "items": {"type": "integer"}},
        "o": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]},
        "either": {"type": ["string", "null"]},
    }, ["s"], additionalProperties=False)
    ok = {"s": "a", "n": 1.5, "i": 2, "b": True, "l": [1, 2], "o": {"k": "v"}, "either": None}
    assert validate_arguments(s, ok) == []
    assert validate_arguments(s["function"]["parameters"], {"s": "b", "n": 3}) == []
    problems = validate_arguments(s, {"n": True, "i": 2.0, "b": "yes", "l": [1, "2"], "o": {}, "zz": 1})
    text = "\n".join(problems)
    for expected in ["missing required argument 's'", "unknown argument(s) 'zz'", "'n' must be number, not a boolean",
                     "'i' must be integer, not a number", "'b' must be boolean, not a string",
                     "'l'[1] must be integer", "missing required argument 'o'.'k'"]:
        assert expected in text, (expected, problems)
    assert validate_arguments(s, {"s": "c"}) == ["argument 's' must be one of ['a', 'b'], not 'c'"]
    assert validate_arguments(s, ["a"]) == ["the arguments must be a JSON object, not an array"]
    assert validate_arguments(schema("free"), {"anything": 1}) == []  # additionalProperties not false


def test_schema_is_checked_and_default_schemas():
    with pytest.raises(ValueError, match="tool_schema must be"):
        Recorder.__bases__[0].__init__(Recorder.__new__(Recorder), {}, {"type": "function"})
    assert CalculatorTool().name == "calculator"
    assert CalculatorTool.default_schema()["function"]["parameters"]["required"] == ["expression"]
