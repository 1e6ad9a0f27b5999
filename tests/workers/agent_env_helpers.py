"""A stateful tool, environment and simulated user for the agent-environment tests, written against the
interfaces users write (verl's tool and interaction methods; hflow's environment). Each records its
lifecycle in `LOG`, so a test can check that everything created was released, whatever happened."""

from __future__ import annotations

import time
import uuid
import zlib
from collections import defaultdict

from hflow.agent.interactions import BaseInteraction
from hflow.agent.parsers import ParsedTurn, ToolCall, ToolCallParser, register_parser
from hflow.agent.tools import BaseTool

LOG: dict[str, list] = defaultdict(list)  # "created", "released", "env_made", "env_closed", "started", "finalized"

TOOL_STEP_REWARD = 0.125


def reset_log() -> None:
    LOG.clear()


@register_parser("test-half-calls")
class HalfCallParser(ToolCallParser):
    """Half the turns (by the text's CRC) call `counter`; the others call nothing (the environment or the
    simulated user answers them, or they are the answer)."""

    def parse(self, text: str) -> ParsedTurn:
        if zlib.crc32(text.encode("utf-8", "replace")) % 2 == 0:
            return ParsedTurn(content=text, calls=[], malformed=[])
        return ParsedTurn(content="", calls=[ToolCall("counter", {})], malformed=[])


class CounterTool(BaseTool):
    """verl's lifecycle: `create` returns (instance_id, response) as verl's tools do; each `execute` counts
    the calls made on its instance; `calc_reward` is the count; `release` forgets it."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.counts: dict[str, int] = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id = instance_id or uuid.uuid4().hex
        self.counts[instance_id] = int(kwargs.get("start", 0))
        LOG["created"].append(instance_id)
        return instance_id, None

    async def execute(self, instance_id, parameters, **kwargs):
        self.counts[instance_id] += 1
        return _Response(f"count={self.counts[instance_id]}"), TOOL_STEP_REWARD, {}

    async def calc_reward(self, instance_id, **kwargs):
        return float(self.counts[instance_id])

    async def release(self, instance_id, **kwargs):
        del self.counts[instance_id]
        LOG["released"].append(instance_id)


class _Response:
    """Like verl's ToolResponse: the text in `.text`."""

    def __init__(self, text: str):
        self.text = text


class CounterEnv:
    """Steps count up from the row's ``extra_info.start``; the reward of step k is k; done at
    ``extra_info.limit``. ``fail_at`` / ``hang_at`` / ``malformed_at`` (a step number) misbehave there.
    Not a subclass of anything: an environment is any class with reset and step."""

    def __init__(self, config):
        self.config = config
        self.steps = 0
        self.id = uuid.uuid4().hex
        LOG["env_made"].append(self.id)

    def reset(self, row):
        self.extra = row["extra_info"]
        self.start = int(self.extra.get("start", 0))
        return f"you start at {self.start}" if self.extra.get("first_observation") else None

    def step(self, action):
        self.steps += 1
        if self.extra.get("fail_at") == self.steps:
            raise RuntimeError("the environment broke")
        if self.extra.get("hang_at") == self.steps:
            time.sleep(self.config["hang_s"])
        if self.extra.get("malformed_at") == self.steps:
            return "no", 1.0, False  # three values, not four
        done = self.steps >= int(self.extra.get("limit", 99))
        return f"step {self.steps} at {self.start + self.steps}", float(self.steps), done, {"steps": self.steps}

    def close(self):
        LOG["env_closed"].append(self.id)


class GuessInteraction(BaseInteraction):
    """verl's interface: says "try again (k)" and scores 0.25 k on its k-th answer; ends the episode on the
    ``extra_info.interaction_kwargs.rounds``-th."""

    def __init__(self, config):
        super().__init__(config)
        self.rounds: dict[str, int] = {}

    async def start_interaction(self, instance_id=None, **kwargs):
        self.rounds[instance_id] = 0
        LOG["started"].append(instance_id)
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        assert messages[-1]["role"] == "assistant" and messages[0]["role"] == "user"  # the prompt, then the turns
        self.rounds[instance_id] += 1
        k = self.rounds[instance_id]
        return k >= int(kwargs.get("rounds", 99)), f"try again ({k})", 0.25 * k, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        del self.rounds[instance_id]
        LOG["finalized"].append(instance_id)
