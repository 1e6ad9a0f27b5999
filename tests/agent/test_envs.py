"""Environment and interaction files, and an episode session's guarantees, without an engine (the engines'
tests are tests/workers/test_agent_envs.py): bad files stop with the entry and key named; a session's
calls are bounded; close releases everything once, even when the user's code fails."""

from __future__ import annotations

import asyncio
import time

import pytest
from omegaconf import OmegaConf

from hflow.agent.config import MultiTurnConfig
from hflow.agent.env import load_envs
from hflow.agent.interactions import load_interactions
from hflow.agent.session import EpisodeSession, bounded
from hflow.agent.tool_config import load_tools
from hflow.algorithms.config import check_turn_rewards
from hflow.trainer.config import default_config
from hflow.utils.errors import ConfigError, UserError

ENV_FILE = '''
class Walk:
    def __init__(self, config):
        self.position = config.get("start", 0)
    def reset(self, row):
        return None
    def step(self, action):
        self.position += 1
        return f"at {self.position}", 0.0, False, {}

class NoStep:
    def __init__(self, config):
        pass
    def reset(self, row):
        return None

class Broken:
    def __init__(self, config):
        raise ValueError("needs a map")
    def reset(self, row):
        return None
    def step(self, action):
        return None
'''


def write(tmp_path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_env_file_loads_a_class_from_a_file_and_chooses_by_agent_name_or_data_source(tmp_path):
    write(tmp_path, "envs.py", ENV_FILE)
    table = load_envs(write(tmp_path, "envs.yaml", "envs:\n  - name: walk\n    class_name: envs.py:Walk\n"
                                      "    config: {start: 3}\n    data_sources: [maze]\n"))
    assert table.for_row({"data_source": "maze"}, "row 0").name == "walk"
    assert table.for_row({"data_source": "other", "agent_name": "walk"}, "row 0").name == "walk"
    assert table.for_row({"data_source": "other"}, "row 0") is None
    assert table.for_row({"data_source": "other", "agent_name": "tool_agent"}, "row 0") is None  # verl's loop names
    with pytest.raises(UserError, match=r"row 7: agent_name='nope' names no environment .* \(it has walk\)"):
        table.for_row({"data_source": "other", "agent_name": "nope"}, "row 7")


@pytest.mark.parametrize("entry, message", [
    ("class_name: envs.py:NoStep", r"envs\[0\].class_name: NoStep has no step\(\) method"),
    ("class_name: envs.py:Missing", r"envs\[0\].class_name='envs.py:Missing': .* defines no class 'Missing'"),
    ("class_name: nowhere.py:Walk", r"envs\[0\].class_name='nowhere.py:Walk': .*nowhere.py does not exist"),
    ("class_name: envs.py:Broken", r"envs\[0\]: Broken\(config\) failed with ValueError: needs a map"),
    ("class_name: envs.py:Walk\n    data_sources: maze", r"envs\[0\].data_sources must be a list"),
    ("class_name: envs.py:Walk\n    step_limit: 3", r"envs\[0\]: unknown key\(s\) \['step_limit'\]"),
])
def test_env_file_errors_name_the_entry_and_key(tmp_path, entry, message):
    write(tmp_path, "envs.py", ENV_FILE)
    with pytest.raises(ConfigError, match=message):
        load_envs(write(tmp_path, "envs.yaml", f"envs:\n  - name: walk\n    {entry}\n"))


def test_two_envs_cannot_share_a_name_or_a_data_source(tmp_path):
    write(tmp_path, "envs.py", ENV_FILE)
    entry = "  - name: {}\n    class_name: envs.py:Walk\n    data_sources: [maze]\n"
    with pytest.raises(ConfigError, match=r"envs\[1\].name='a' is also envs\[0\]'s"):
        load_envs(write(tmp_path, "a.yaml", "envs:\n" + entry.format("a") + entry.format("a")))
    with pytest.raises(ConfigError, match=r"envs\[1\].data_sources: 'maze' is also in envs\[0\]"):
        load_envs(write(tmp_path, "b.yaml", "envs:\n" + entry.format("a") + entry.format("b")))


def test_interaction_file_in_verls_layout(tmp_path):
    """verl's rule for a missing name (the class name without "Interaction", lower case) and verl's own
    class paths, which are not part of hflow, get a message that says what to do."""
    table = load_interactions(write(tmp_path, "i.yaml", "interaction:\n  - class_name: "
                                    "\"tests.workers.agent_env_helpers.GuessInteraction\"\n    config: {}\n"))
    assert list(table.by_name) == ["guess"] and table.by_name["guess"].config == {"name": "guess"}
    assert table.for_row({"query": "2+2"}, "row 0") is table.by_name["guess"]  # one interaction: no name needed
    assert table.for_row({}, "row 0") is None
    with pytest.raises(ConfigError, match=r"importing verl.interactions.gsm8k_interaction failed .* point class_name "
                                          r"at your class"):
        load_interactions(write(tmp_path, "v.yaml", "interaction:\n  - name: gsm8k\n    class_name: "
                                "verl.interactions.gsm8k_interaction.Gsm8kInteraction\n    config: {}\n"))
    with pytest.raises(ConfigError, match=r"interaction\[0\].class_name: CounterTool lacks start_interaction"):
        load_interactions(write(tmp_path, "t.yaml", "interaction:\n  - class_name: "
                                "tests.workers.agent_env_helpers.CounterTool\n"))


def test_tool_file_takes_verls_native_type_and_refuses_mcp(tmp_path):
    tool = ("tools:\n  - class_name: calculator\n    config:\n      type: {}\n")
    assert list(load_tools(write(tmp_path, "a.yaml", tool.format("native")))) == ["calculator"]
    with pytest.raises(ConfigError, match=r"tools\[0\].config.type='mcp': hflow runs native tools only"):
        load_tools(write(tmp_path, "b.yaml", tool.format("mcp")))


def test_turn_return_needs_grpo():
    algo = default_config().algorithm
    OmegaConf.update(algo, "turn_rewards", "turn_return")
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=gae; use adv_estimator=grpo"):
        check_turn_rewards(algo)
    OmegaConf.update(algo, "turn_rewards", "tokens")
    with pytest.raises(ConfigError, match="algorithm.turn_rewards='tokens' is not one of"):
        check_turn_rewards(algo)


def test_bounded_gives_up_on_a_sync_call_that_hangs():
    started = time.perf_counter()
    kind, message = asyncio.run(bounded(time.sleep, 5, timeout_s=0.2))
    assert kind == "timeout" and "sleep did not return within 0.2 s" in message
    assert time.perf_counter() - started < 2


class FailingTool:
    """A tool whose calc_reward raises and whose release hangs, the first time."""

    tool_schema = {"type": "function", "function": {"name": "bad", "parameters": {}}}
    name = "bad"
    parameters: dict = {}

    def __init__(self):
        self.released: list[str] = []

    async def create(self, instance_id=None, **kwargs):
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        return "ok", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        raise RuntimeError("no reward")

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)
        await asyncio.sleep(10)


def test_close_releases_once_and_never_raises():
    config = MultiTurnConfig(tool_timeout_s=0.2, env_timeout_s=0.2)
    tool = FailingTool()
    session = EpisodeSession(config, {"bad": tool}, {}, {"extra_info": {}})

    async def run():
        await session.start()
        first = await session.close()
        second = await session.close()
        return first, second

    first, second = asyncio.run(run())
    assert len(tool.released) == 1 and tool.released[0] == session.instances["bad"]
    assert sorted(first.problems) == ["calc_reward_raised", "release_timeout"]
    assert second.problems == [] and second.rewards == []
