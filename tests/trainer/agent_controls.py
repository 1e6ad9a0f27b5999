"""A calculator that is out of order, for the control runs of the built-in agentic task
(tests/trainer/test_agent_task_learns.py, bench/agent_task.py): every call returns an error to the model, so
calling the tool can no longer pay, and nothing should be learned."""

from pathlib import Path


def calculator(expression: str) -> str:
    raise RuntimeError("the calculator is out of order")


def write_broken_tools(path: Path) -> Path:
    """A tool config (verl's layout) whose `calculator` is the function above; returns `path`."""
    path.write_text(f"""tools:
  - function: {Path(__file__).resolve()}:calculator
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression exactly.
        parameters: {{type: object, properties: {{expression: {{type: string}}}}, required: [expression]}}
""")
    return path
