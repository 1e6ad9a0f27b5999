"""Multi-turn agent rollouts: tool-call parsers, tools, and the loop that runs them.

`hflow.agent.parsers` reads tool calls out of an assistant turn (``hermes`` built in, others
registered with `register_parser`); `hflow.agent.tools` holds the tool interface, the built-in tools
(calculator, python) and `run_tool_call`, the one safe way to run a call; `hflow.agent.tool_config`
loads tools from a YAML file; `hflow.agent.env` (environments) and `hflow.agent.interactions` (verl's
simulated users) load theirs; `hflow.agent.session` holds one episode's instances of all three.
"""

from hflow.agent.env import BaseEnv, load_envs
from hflow.agent.interactions import BaseInteraction, load_interactions
from hflow.agent.parsers import ParsedTurn, ToolCall, ToolCallParser, get_parser, register_parser
from hflow.agent.tool_config import builtin_tools, load_tools, tool_schemas
from hflow.agent.tools import (
    BaseTool,
    CalculatorTool,
    FunctionTool,
    PythonTool,
    ToolError,
    ToolOutcome,
    malformed_outcome,
    run_tool_call,
    validate_arguments,
)

__all__ = [
    "BaseEnv",
    "BaseInteraction",
    "BaseTool",
    "CalculatorTool",
    "FunctionTool",
    "ParsedTurn",
    "PythonTool",
    "ToolCall",
    "ToolCallParser",
    "ToolError",
    "ToolOutcome",
    "builtin_tools",
    "get_parser",
    "load_envs",
    "load_interactions",
    "load_tools",
    "malformed_outcome",
    "register_parser",
    "run_tool_call",
    "tool_schemas",
    "validate_arguments",
]
