"""Stateful episodes through the real engines: tools that keep their instance for the episode, environments,
simulated users (verl's interaction files), turn rewards on the right tokens, and every instance released
whatever ends the episode or the rollout.

The random tiny model cannot write tool calls: `test-half-calls` makes half the turns (by a CRC of their
text) call the `counter` tool, and the others are answered by the row's environment or simulated user (see
`agent_env_helpers`). The tool, environment and simulated user answer with their state (a count, a step
number), so a trajectory shows whether state was kept; the tool and interaction files are written in
verl's documented layout, as a verl user has them.
"""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from hflow.agent.chat import ToolMessageEncoder
from tests.workers import agent_env_helpers as helpers
from tests.workers.test_multi_turn_rollout import Recorder, end_turns_often
from tests.workers.test_rollout import make_prompts, push, rollout_config

RESPONSE_LENGTH = 192
MAX_TURNS = 6
HANG_S = 3.0
ENV_TIMEOUT_S = 1.0

# verl's layouts, as its docs and examples write them (quotes, `type: native`, a name per interaction)
VERL_TOOLS = '''tools:
  - class_name: "tests.workers.agent_env_helpers.CounterTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "counter"
        description: "Count how many times it was called in this conversation."
        parameters:
          type: "object"
          properties: {}
          required: []
'''
VERL_INTERACTIONS = '''interaction:
  - name: "guess"
    class_name: "tests.workers.agent_env_helpers.GuessInteraction"
    config: {}
'''
ENVS = f'''envs:
  - name: counter
    class_name: tests.workers.agent_env_helpers.CounterEnv
    config: {{hang_s: {HANG_S}}}
    data_sources: [counter_env]
'''

# (question, data_source, extra_info, agent_name): what each prompt exercises
ROWS = [
    ("What is 17 plus 25?", "plain", {}, None),  # tools only
    ("Count with me.", "counter_env", {"start": 10, "limit": 3, "first_observation": True}, None),
    ("Count again.", "other", {"start": 0, "limit": 2}, "counter"),  # chosen by agent_name
    ("Guess a number.", "plain", {"interaction_kwargs": {"name": "guess", "rounds": 2}}, None),
    # more simulated-user episodes: the random tiny model's turn can run to the length limit before the user
    # ends it, so a batch with only two of them saw none end by the interaction about one time in four
    ("Guess once.", "plain", {"interaction_kwargs": {"name": "guess", "rounds": 1}}, None),
    ("Guess again.", "plain", {"interaction_kwargs": {"name": "guess", "rounds": 1}}, None),
    ("Break.", "counter_env", {"fail_at": 1}, None),
    ("Hang.", "counter_env", {"hang_at": 1}, None),
    ("Garble.", "counter_env", {"malformed_at": 1}, None),
]


@pytest.fixture(scope="module")
def agent_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("agent-files")
    files = {"tool_config_path": VERL_TOOLS, "interaction_config_path": VERL_INTERACTIONS, "env_config_path": ENVS}
    for key, text in files.items():
        (folder / f"{key}.yaml").write_text(text)
    return {key: str(folder / f"{key}.yaml") for key in files}


def agent_config(files: dict[str, str], **overrides):
    return rollout_config(**{
        "n": 2,
        "response_length": RESPONSE_LENGTH,
        "multi_turn.enable": True,
        "multi_turn.format": "test-half-calls",
        "multi_turn.max_assistant_turns": MAX_TURNS,
        "multi_turn.env_timeout_s": ENV_TIMEOUT_S,
        **{f"multi_turn.{key}": path for key, path in files.items()},
        **overrides,
    })


def agent_prompts(tokenizer, rows=ROWS):
    questions = [question for question, *_ in rows]
    kwargs = [{"data_source": source, "agent_name": agent, "extra_info": extra,
               "prompt": [{"role": "user", "content": question}]} for question, source, extra, agent in rows]
    tools_kwargs = [{"counter": {"create_kwargs": {"start": 0}}} for _ in rows]
    return make_prompts(tokenizer, questions, agent_kwargs=np.array(kwargs, dtype=object),
                        tools_kwargs=np.array(tools_kwargs, dtype=object))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return end_turns_often(model, tiny_tokenizer, strength=0.2)  # short turns: several per episode


@pytest.fixture(scope="module")
def vllm_rollout(world, tiny_model_dir, tiny_tokenizer, agent_files):
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    rollout = vLLMRollout(str(tiny_model_dir), agent_config(agent_files), tiny_tokenizer,
                          AutoConfig.from_pretrained(tiny_model_dir))
    yield rollout
    del rollout
    gc.collect()


def step_reward(message: dict) -> float:
    """The reward that came with a tool or user message (the helpers' rules)."""
    content = message["content"]
    if content.startswith("count="):
        return helpers.TOOL_STEP_REWARD
    if content.startswith("step "):
        return float(content.split()[1])
    if content.startswith("try again ("):
        return 0.25 * int(content[len("try again ("):-1])
    return 0.0  # the first observation


def check_episodes(output, tokenizer, turns: dict[int, list[list[int]]], rows=ROWS, n: int = 2) -> list[dict]:
    """For every episode: ids = sampled turns with each reply's rendered ids between them (mask 1 exactly on
    sampled ids); the tool's count and the environment's step go up by one per call / step within the
    episode (state kept); each reward sits on the last sampled token of the turn it judges, the final
    tool reward (its count) on the episode's last sampled token. Returns the episode summaries."""
    encoder = ToolMessageEncoder(tokenizer)
    episodes = list(output.non_tensor_batch["episode"])
    assert len(episodes) == len(rows) * n
    for index, episode in enumerate(episodes):
        question, source, extra, agent = rows[index // n]
        messages = list(episode["messages"])
        expected, mask, rewards = [], [], [0.0] * RESPONSE_LENGTH
        if extra.get("first_observation"):  # an empty assistant turn, then the environment's first observation
            assert messages[:2] == [{"role": "assistant", "content": ""},
                                    {"role": "user", "content": f"you start at {extra['start']}"}]
            expected += encoder.after_prompt([messages[1]])
            mask += [0] * len(expected)
            messages = messages[2:]
        sampled_turns = turns[index]
        counts, steps = [], []
        for sampled in sampled_turns:
            assert messages.pop(0)["role"] == "assistant"
            expected += sampled
            mask += [1] * len(sampled)
            replies = []
            while messages and messages[0]["role"] != "assistant":
                replies.append(messages.pop(0))
            if replies:
                expected += encoder.encode(replies)
                mask += [0] * (len(expected) - len(mask))
            last = max(i for i, m in enumerate(mask) if m)
            for reply in replies:
                rewards[last] += step_reward(reply)
                if reply["content"].startswith("count="):
                    counts.append(int(reply["content"].split("=")[1]))
                elif reply["content"].startswith("step "):
                    steps.append(reply["content"])
        assert not messages
        assert counts == list(range(1, len(counts) + 1)), f"the tool lost its state: {counts}"
        start = extra.get("start", 0)
        assert steps == [f"step {k} at {start + k}" for k in range(1, len(steps) + 1)], steps
        last = max(i for i, m in enumerate(mask) if m)
        assert mask[-1] == 1, "an episode ends on a sampled token"
        ended = episode["ended"]
        if ended == "env_done":
            rewards[last] += float(extra["limit"])  # the last step's reward; its observation is not shown
            assert len(steps) == extra["limit"] - 1
        if ended == "interaction_done":
            rewards[last] += 0.25 * extra["interaction_kwargs"]["rounds"]
        rewards[last] += float(len(counts))  # calc_reward: the episode's count, on its last sampled token
        length = len(expected)
        assert output.batch["responses"][index, :length].tolist() == expected
        assert output.batch["response_mask"][index].tolist() == mask + [0] * (RESPONSE_LENGTH - length)
        got = output.batch["turn_rewards"][index].tolist()
        if ended == "length":  # a reply that did not fit is not shown, but its reward was earned: skip that token
            got[last] = rewards[last] = 0.0
        assert got == rewards, (index, episode)
        # what ends each row, and how
        if "fail_at" in extra or "hang_at" in extra or "malformed_at" in extra:
            want = "env_error" if "fail_at" in extra else "env_timeout" if "hang_at" in extra else "env_malformed"
            assert ended in (want, "length", "max_assistant_turns"), (index, ended)
        elif source == "plain" and "interaction_kwargs" not in extra:
            assert ended in ("answer", "length", "max_assistant_turns") and not steps
    return episodes


def check_all_released() -> None:
    log = helpers.LOG
    assert log["created"] and sorted(log["created"]) == sorted(log["released"])
    assert sorted(log["env_made"]) == sorted(log["env_closed"])
    assert sorted(log["started"]) == sorted(log["finalized"])


def test_vllm_stateful_episodes_with_verl_files(vllm_rollout, tiny_tokenizer, hf_model, monkeypatch):
    """One batch through vLLM, verl's tool and interaction files unchanged: state kept across turns, ids and
    masks exact (user and tool messages masked), rewards on their turns' last tokens, bad environments end
    only their own episodes (named, counted), and every tool, environment and interaction released."""
    import hflow.workers.rollout.vllm_rollout as module

    recorder = Recorder(monkeypatch, module, "_StreamingEngine")
    helpers.reset_log()
    push(vllm_rollout, hf_model)
    torch.manual_seed(0)
    output = vllm_rollout.generate_sequences(agent_prompts(tiny_tokenizer))

    episodes = check_episodes(output, tiny_tokenizer, recorder.turns)
    check_all_released()
    endings = [e["ended"] for e in episodes]
    for reason in ("env_done", "interaction_done", "env_error", "env_timeout", "env_malformed"):
        assert reason in endings, f"no episode ended {reason}: {endings}"
    metrics = output.meta_info["metrics"]
    assert metrics["agent/ended/env_error"] > 0 and metrics["agent/ended/env_timeout"] > 0
    assert metrics["agent/turn_reward/mean"] > 0
    assert any(max(int(m["content"][6:]) for m in e["messages"] if m["content"].startswith("count=")) > 1
               for e in episodes if any(m["content"].startswith("count=") for m in e["messages"])), \
        "no episode called the tool twice: state across calls was not tested"


def test_releases_when_the_rollout_stops_midway(vllm_rollout, tiny_tokenizer, hf_model, monkeypatch):
    """The engine fails midway (as a cancelled rollout does): the error reaches the caller and every tool,
    environment and interaction created so far is released first."""
    import hflow.workers.rollout.vllm_rollout as module

    class Failing(module._StreamingEngine):
        polls = 0

        def poll(self):
            Failing.polls += 1
            if Failing.polls == 40:
                raise RuntimeError("stopped")
            return super().poll()

    monkeypatch.setattr(module, "_StreamingEngine", Failing)
    helpers.reset_log()
    push(vllm_rollout, hf_model)
    with pytest.raises(RuntimeError, match="stopped"):
        vllm_rollout.generate_sequences(agent_prompts(tiny_tokenizer, ROWS[:4]))
    assert helpers.LOG["created"] and helpers.LOG["env_made"] and helpers.LOG["started"]
    check_all_released()


def test_partial_rollout_update_keeps_episode_state(vllm_rollout, tiny_tokenizer, hf_model, monkeypatch):
    """A weight update that interrupts the turns in flight (partial rollouts) continues them; the episodes
    keep their tool and environment instances through it, and release them once at the end."""
    import hflow.workers.rollout.vllm_rollout as module
    from tests.workers.test_rollout import UpdateAfterSteps, perturb_

    recorder = Recorder(monkeypatch, module, "_StreamingEngine")
    new_model = copy.deepcopy(hf_model)
    perturb_(new_model, torch.Generator().manual_seed(7), scale=0.05)
    helpers.reset_log()
    push(vllm_rollout, hf_model)
    updates = UpdateAfterSteps(vllm_rollout, new_model, after=12, partial=True)
    torch.manual_seed(0)
    output = vllm_rollout.generate_sequences(agent_prompts(tiny_tokenizer, ROWS[:4]), weight_updates=updates)
    assert output.meta_info["metrics"]["rollout/interrupted_requests"] > 0
    episodes = check_episodes(output, tiny_tokenizer, recorder.turns, rows=ROWS[:4])
    versions = output.batch["rollout_versions"]
    assert any((row == 0).any() and (row == 1).any() for row in versions), "no episode spans the update"
    assert any(e["num_turns"] > 1 for e in episodes)
    check_all_released()
    assert len(helpers.LOG["released"]) == len(set(helpers.LOG["released"])), "a tool was released twice"


def test_hf_rollout_honours_max_user_turns(agent_files, tiny_tokenizer, hf_model, monkeypatch):
    """The HF rollout (waves) runs the same sessions; a simulated user that never ends the episode is cut by
    max_user_turns, which counts tool, environment and user messages alike."""
    import hflow.workers.rollout.hf_rollout as module
    from hflow.workers.rollout import HFRollout

    recorder = Recorder(monkeypatch, module, "_WaveEngine")
    rows = [("Guess a number.", "plain", {"interaction_kwargs": {"name": "guess", "rounds": 99}}, None),
            ("Count with me.", "counter_env", {"start": 5, "limit": 99}, None)]
    rollout = HFRollout(hf_model, agent_config(agent_files, n=1, **{"multi_turn.max_user_turns": 2}), tiny_tokenizer)
    helpers.reset_log()
    torch.manual_seed(0)
    output = rollout.generate_sequences(agent_prompts(tiny_tokenizer, rows))
    episodes = check_episodes(output, tiny_tokenizer, recorder.turns, rows=rows, n=1)
    check_all_released()
    for episode in episodes:
        assert episode["num_tool_turns"] <= 2
    assert any(e["ended"] == "max_user_turns" for e in episodes), [e["ended"] for e in episodes]
