"""An external agent for hflow's agent endpoint: the built-in calculator task, written with the `openai` client.

hflow calls `run_episode(base_url, episode_id, row)` once per sample while a step generates, with the base
URL of its OpenAI-compatible endpoint (the policy being trained) and the episode's id; every request of
the episode carries that id. The agent runs its own tools: here the calculator, on the model's tool calls.
hflow records the token ids it samples and renders, so the agent can be any code that takes a `base_url`.

    scripts/train.sh algorithm.adv_estimator=grpo \
        actor_rollout_ref.rollout.multi_turn.enable=true \
        actor_rollout_ref.rollout.multi_turn.endpoint.enable=true \
        actor_rollout_ref.rollout.multi_turn.endpoint.agent_path=$PWD/examples/agent/openai_agent.py
"""

import json

import openai

from hflow.agent.calculator import evaluate  # any calculator would do; this one is exact

MAX_TURNS = 3


def calculator(expression: str) -> str:
    try:
        return evaluate(expression)
    except ValueError as err:
        return f"Error: {err}"


TOOLS = {"calculator": calculator}  # the agent's own tools, by the name the model calls


def run_tool(name: str, arguments: str) -> str:
    """The result of one tool call, or an error the model reads in the tool message."""
    if name not in TOOLS:
        return f"Error: unknown tool {name!r}; the tools are {sorted(TOOLS)}"
    try:
        return TOOLS[name](**json.loads(arguments))
    except (TypeError, json.JSONDecodeError) as err:
        return f"Error: {err}"


def run_episode(base_url: str, episode_id: str, row: dict):
    """One episode of `row` (its `prompt` messages, the `tools` its prompt was rendered with, its
    `extra_info`, ...). The return value, if any, is a reward on the episode's last sampled token, or a
    dict with "reward" and other keys kept in the episode's info; the task's reward function scores the
    episode as usual."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                           default_headers={"X-Episode-Id": episode_id})
    messages = list(row["prompt"])
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=row["tools"])
        except openai.BadRequestError as err:  # e.g. the next message would not fit in the response budget
            return {"stopped": err.code}
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))  # re-sent as returned
        if choice.finish_reason != "tool_calls":
            return None
        for call in choice.message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
