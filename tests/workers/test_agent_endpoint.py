"""External agents through the OpenAI-compatible endpoint (`hflow.agent.endpoint`), on the real vLLM engine.

An `openai`-client agent that speaks the same tool protocol as hflow's loop (the test parser of
`test_multi_turn_rollout` decides which turns call `echo`; the agent runs `echo` itself) produces, row for
row and with the same seeds, the trajectories hflow's own loop produces: the same ids, loss mask and sampler
log-probs. The tiny model's byte-level tokenizer re-encodes sampled text into other ids, so an endpoint that
re-tokenized the agent's history would not match. Bad requests get an HTTP error that names the episode and
what is wrong.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig

from hflow.workers.rollout.base import prompt_token_ids
from tests.workers.test_multi_turn_rollout import MAX_TURNS, QUESTIONS, hf_model, multi_turn_config, tool_config  # noqa: F401
from tests.workers.test_rollout import PROMPT_LENGTH, make_prompts, push, rollout_config

# The external agent: plain openai client, no hflow import. It does what hflow's loop does with the echo
# tool: run each call, send its result as a tool message, stop after MAX_TURNS turns, at a turn without
# calls, at a turn cut by the length limit, or when the endpoint says the next message does not fit.
AGENT = '''
import json

import openai

MAX_TURNS = {max_turns}


def echo(text):
    return "echo 12345: " + text


def run_episode(base_url, episode_id, row):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                           default_headers={{"X-Episode-Id": episode_id}})
    messages = list(row["prompt"])
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=row["tools"])
        except openai.BadRequestError as err:
            if err.code == "context_too_long":
                return {{"reward": 0.0}}
            raise
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            break
        for call in choice.message.tool_calls:
            result = echo(**json.loads(call.function.arguments))
            messages.append({{"role": "tool", "tool_call_id": call.id, "content": result}})
    return {{"reward": 1.0, "turns": len(messages)}}
'''.format(max_turns=MAX_TURNS)


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("agent") / "agent.py"
    path.write_text(AGENT)
    return str(path)


@pytest.fixture(scope="module")
def endpoint_rollout(world, tiny_model_dir, tiny_tokenizer, tool_config, agent_file, hf_model):  # noqa: F811
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    config = multi_turn_config(tool_config, **{"multi_turn.endpoint.enable": True,
                                               "multi_turn.endpoint.agent_path": agent_file})
    rollout = vLLMRollout(str(tiny_model_dir), config, tiny_tokenizer, AutoConfig.from_pretrained(tiny_model_dir))
    push(rollout, hf_model)
    yield rollout
    rollout.close()
    del rollout
    gc.collect()


def prompts_with_rows(tokenizer):
    rows = np.array([{"data_source": "test", "agent_name": None, "extra_info": {},
                      "prompt": [{"role": "user", "content": q}]} for q in QUESTIONS], dtype=object)
    return make_prompts(tokenizer, QUESTIONS, agent_kwargs=rows)


def test_an_openai_agent_through_the_endpoint_gives_hflows_own_trajectories(endpoint_rollout, tiny_tokenizer):
    from hflow.trainer.ppo.routed_rollout import assemble_routed
    from hflow.workers.rollout.router import RouterClient, RowRouter

    prompts, n = prompts_with_rows(tiny_tokenizer), 4
    stop = {"eos_token_id": prompts.meta_info["eos_token_id"], "pad_token_id": prompts.meta_info["pad_token_id"]}
    # hflow's loop, each request seeded by (rollout seed, batch, row, turn); the endpoint's k-th call is batch k
    batch = endpoint_rollout._endpoint_calls
    router = RowRouter(engines=1)
    router.submit(batch, [{"ids": ids, "tools_kwargs": {}} for ids in prompt_token_ids(prompts) for _ in range(n)],
                  {}, min_version=0)
    endpoint_rollout.serve(RouterClient(router), 0, stop)
    loop = assemble_routed(prompts, {}, n, router.collect(batch), endpoint_rollout.config)

    external = endpoint_rollout.generate_sequences(prompts)

    episodes = external.non_tensor_batch["episode"]
    assert len(external) == len(QUESTIONS) * n
    assert all(e["ended"] != "agent_error" for e in episodes), [e["info"] for e in episodes]
    for key in ("responses", "response_mask", "attention_mask", "input_ids", "position_ids"):
        assert external.batch[key].tolist() == loop.batch[key].tolist(), key
    # Same ids, same seeds: the log-probs are equal up to the engine batching the turns differently (requests
    # arrive over HTTP on their own clock; CPU kernels are not batch-invariant): seen 1e-6 apart under load.
    torch.testing.assert_close(external.batch["rollout_log_probs"], loop.batch["rollout_log_probs"], rtol=0, atol=1e-5)
    # not vacuous: several turns with tool messages (mask 0 inside a response), sampled ids that re-encode
    # to other ids, and the agent's return value credited to the last sampled token
    mask = external.batch["response_mask"]
    inside = external.batch["attention_mask"][:, -mask.shape[1]:].bool() & (mask == 0)
    assert inside.any(), "no tool message in any episode"
    assert max(e["num_turns"] for e in episodes) == MAX_TURNS
    assert {e["ended"] for e in episodes} <= {"agent_done", "length"}
    drift = 0
    for row in range(len(external)):
        sampled = external.batch["responses"][row][mask[row].bool()].tolist()
        drift += tiny_tokenizer.encode(tiny_tokenizer.decode(sampled), add_special_tokens=False) != sampled
        last = int(mask[row].nonzero().max())
        reward = external.batch["turn_rewards"][row]
        assert reward[last].item() in (0.0, 1.0) and reward.abs().sum() == reward[last].abs()
    assert drift > 0, "the tokenizer re-encodes these samples faithfully: a re-tokenizing endpoint would pass"
    assert external.batch["turn_rewards"].sum() > 0
    metrics = external.meta_info["metrics"]
    assert metrics["agent/ended/agent_error"] == 0 and metrics["agent/ended/agent_timeout"] == 0


def test_bad_requests_get_http_errors_that_say_which(endpoint_rollout, tiny_tokenizer, monkeypatch):
    import openai

    errors: dict[str, openai.APIStatusError] = {}
    answers: dict[str, object] = {}
    episode_ids: dict[int, str] = {}

    def client(base_url, episode_id):
        return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                             default_headers={"X-Episode-Id": episode_id})

    def expect_error(name, call):
        try:
            call()
        except openai.APIStatusError as err:
            errors[name] = err
        else:
            raise AssertionError(f"{name}: the endpoint accepted the request")

    def agent(base_url, episode_id, row):
        api = client(base_url, episode_id)
        key = row["index"]
        episode_ids[key] = episode_id
        if key == 0:
            expect_error("unknown", lambda: client(base_url, "ep-nope-0").chat.completions.create(
                model="p", messages=row["prompt"]))
            expect_error("long_prompt", lambda: api.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "word " * 400}]))
            expect_error("other_prompt", lambda: api.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "Another question?"}]))
        elif key == 1:
            first = api.chat.completions.create(model="p", messages=row["prompt"])
            said = first.choices[0].message.model_dump(exclude_none=True)
            changed = {**said, "content": (said.get("content") or "") + " (edited)"}
            expect_error("changed", lambda: api.chat.completions.create(
                model="p", messages=[*row["prompt"], changed, {"role": "user", "content": "go on"}]))
            expect_error("not_longer", lambda: api.chat.completions.create(model="p", messages=[*row["prompt"], said]))
            expect_error("too_long", lambda: api.chat.completions.create(
                model="p", messages=[*row["prompt"], said, {"role": "user", "content": "word " * 400}]))
            answers["chat"] = api.chat.completions.create(
                model="p", messages=[*row["prompt"], said, {"role": "user", "content": "go on"}], max_tokens=4)
        elif key == 2:  # completions with token ids: the recorded ids must lead every later prompt
            ids = row["prompt_ids"]
            first = api.completions.create(model="p", prompt=ids, max_tokens=4)
            sampled = first.choices[0].model_extra["token_ids"]
            expect_error("changed_ids", lambda: api.completions.create(
                model="p", prompt=ids[:-1] + [ids[-1] + 1] + sampled + [10], max_tokens=4))
            answers["completion"] = api.completions.create(model="p", prompt=ids + sampled + [10, 11], max_tokens=4)
        elif key == 3:  # an agent that fails after a turn: its episode ends, the step goes on
            api.chat.completions.create(model="p", messages=row["prompt"], max_tokens=2)
            raise RuntimeError("the agent's own bug")
        elif key == 4:  # an agent that hangs past episode_timeout_s is abandoned
            release.wait(timeout=60)
        return None

    monkeypatch.setattr(endpoint_rollout.multi_turn, "agent", agent)
    monkeypatch.setitem(endpoint_rollout.multi_turn.endpoint, "episode_timeout_s", 5.0)
    monkeypatch.setitem(endpoint_rollout.multi_turn.endpoint, "max_failed_share", 1.0)  # most rows send nothing
    release = threading.Event()
    try:
        output = endpoint_rollout.generate_sequences(prompts_with_rows(tiny_tokenizer))
    finally:
        release.set()
    ids = [e["messages"] for e in output.non_tensor_batch["episode"]]
    assert len(ids) == len(QUESTIONS) * 4

    def check(name, status, *words):
        assert name in errors, (name, [(e["ended"], e["info"]) for e in output.non_tensor_batch["episode"][:3]])
        err = errors[name]
        message = err.body["message"] if isinstance(err.body, dict) else str(err)
        assert err.status_code == status, (name, err.status_code, message)
        for word in words:
            assert word in message, (name, word, message)

    check("unknown", 404, "unknown episode id 'ep-nope-0'")
    check("long_prompt", 400, "the prompt is", f"the limit is {PROMPT_LENGTH} (data.max_prompt_length)")
    check("other_prompt", 400, "message 0 differs from the row's prompt")
    check("changed", 400, "message 1 differs from the episode's recorded message 1", "(edited)")
    check("not_longer", 400, "the request has 2 messages and the episode recorded 2")
    check("too_long", 400, "the limit is 160 (data.max_response_length)")
    check("changed_ids", 400, "token ")
    for name, key in [("long_prompt", 0), ("other_prompt", 0), ("changed", 1), ("not_longer", 1), ("too_long", 1),
                      ("changed_ids", 2)]:
        assert errors[name].body["message"].startswith(f"episode {episode_ids[key]}:"), (name, errors[name].body)
    # the refused requests changed nothing: the accepted ones continue the recorded trajectory
    assert answers["chat"].choices[0].finish_reason in ("stop", "length", "tool_calls")
    mask = output.batch["response_mask"]
    assert mask[1].sum() > 0 and (mask[1] == 0)[: int(mask[1].nonzero().max())].any()  # turn, user message, turn
    assert output.batch["responses"][2][mask[2] == 0][:2].tolist()[:2] == [10, 11]
    assert mask[0].sum() == 0 and output.non_tensor_batch["episode"][0]["num_turns"] == 0
    episodes = output.non_tensor_batch["episode"]
    assert episodes[3]["ended"] == "agent_error" and "the agent's own bug" in str(episodes[3]["info"])
    assert episodes[3]["num_turns"] == 1 and mask[3].sum() > 0
    assert episodes[4]["ended"] == "agent_timeout"
    assert {e["ended"] for e in episodes[5:]} == {"agent_done"}
    metrics = output.meta_info["metrics"]
    assert metrics["agent/endpoint_refused/changed_history"] > 0
    assert metrics["agent/endpoint_refused/unknown_episode"] > 0


EXAMPLE_AGENT = Path(__file__).resolve().parents[2] / "examples" / "agent" / "openai_agent.py"


def example_agent():
    """examples/agent/openai_agent.py's agent function, loaded as the config would load it."""
    from hflow.agent.config import load_agent

    return load_agent(OmegaConf.create({"agent_path": str(EXAMPLE_AGENT), "agent_name": "run_episode"}))


@pytest.fixture(scope="module")
def agent_task_rollout(world):
    """A vLLM rollout of the built-in agentic task's model (which starts a calculator call in about a quarter
    of its samples and copies the result into its answer), its Hermes format and its tools, serving the
    example agent through the endpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hflow.tasks.agent_task import ensure_agent_assets
    from hflow.workers.rollout.vllm_rollout import vLLMRollout

    assets = ensure_agent_assets()
    tokenizer = AutoTokenizer.from_pretrained(assets.model_path)
    config = rollout_config(**{"n": 8, "temperature": 1.0, "response_length": 64, "multi_turn.enable": True,
                               "multi_turn.format": "hermes", "multi_turn.tool_config_path": assets.tool_config_file,
                               "multi_turn.max_assistant_turns": 3, "multi_turn.endpoint.enable": True,
                               "multi_turn.endpoint.agent_path": str(EXAMPLE_AGENT)})
    rollout = vLLMRollout(assets.model_path, config, tokenizer, AutoConfig.from_pretrained(assets.model_path))
    push(rollout, AutoModelForCausalLM.from_pretrained(assets.model_path, dtype=torch.float32))
    yield rollout, tokenizer
    rollout.close()
    del rollout
    gc.collect()


def test_the_example_calculator_agent_calls_the_calculator_and_answers(agent_task_rollout):
    """examples/agent/openai_agent.py on the task it was written for, through the endpoint: in some episodes the
    model calls the calculator, the agent runs it (the tool message is the product), and the model's next turn,
    the episode's last, is the answer (the product again: the model copies it). The others guess at once."""
    from hflow.tasks.agent_task import Multiplication

    rollout, tokenizer = agent_task_rollout
    problems = [Multiplication(37, 86), Multiplication(12, 45), Multiplication(64, 23), Multiplication(91, 58)]
    rows = np.array([{"data_source": "hflow/multiply", "agent_name": None, "extra_info": {},
                      "prompt": [{"role": "user", "content": p.question}]} for p in problems], dtype=object)
    output = rollout.generate_sequences(make_prompts(tokenizer, [p.question for p in problems], agent_kwargs=rows))

    episodes = output.non_tensor_batch["episode"]
    assert all(e["ended"] != "agent_error" for e in episodes), [e["info"] for e in episodes]
    answered = []
    for key, episode in enumerate(episodes):
        answer = str(problems[key // 8].answer)
        tools = [m["content"] for m in episode["messages"] if m["role"] == "tool"]
        if tools == [answer]:  # one successful call: the calculator's exact result
            assistant = [m for m in episode["messages"] if m["role"] == "assistant"]
            assert len(assistant) == 2 and episode["messages"][-1] is assistant[-1], episode["messages"]
            answered.append((episode["ended"], assistant[-1]["content"].strip(), answer))
        else:
            assert tools == [], tools  # no call: the model guessed, and that was the episode
    assert answered, [e["messages"] for e in episodes]
    assert sum(ended == "agent_done" and text == answer for ended, text, answer in answered) >= 1, answered


def test_the_example_agent_answers_a_call_to_a_tool_it_does_not_have_with_an_error(endpoint_rollout, tiny_tokenizer,
                                                                                   monkeypatch):
    """The test parser's calls name `echo`, which the example does not have: each gets an error tool message that
    names the tool, and the episodes run on to their ends."""
    monkeypatch.setattr(endpoint_rollout.multi_turn, "agent", example_agent())
    output = endpoint_rollout.generate_sequences(prompts_with_rows(tiny_tokenizer))
    episodes = output.non_tensor_batch["episode"]
    assert {e["ended"] for e in episodes} <= {"agent_done", "length"}, [e["info"] for e in episodes]
    tool_messages = [m["content"] for e in episodes for m in e["messages"] if m["role"] == "tool"]
    assert tool_messages and all(m.startswith("Error: unknown tool 'echo'") for m in tool_messages), tool_messages


def test_a_vault_episode_through_the_endpoint_is_scored_by_the_agents_verdict(endpoint_rollout, tiny_tokenizer,
                                                                              monkeypatch, tmp_path):
    """examples/agent/vault_agent.py owns each episode's VaultEnv, which hflow never sees: the score is the verdict
    the agent returns, kept in the episode's info and read by the task's scorer through the reward manager. The
    random model cannot play, so its turns reach the environment replaced: a look, then the code it showed (the
    first question's episodes) or another code (the others). The run's environment entry reaches the agent too: with
    the reset-every-turn control's, the code shown is never the one checked, and nothing opens."""
    from hflow.agent.config import load_agent
    from hflow.agent.env import load_envs
    from hflow.reward.managers.naive import NaiveRewardManager
    from hflow.tasks.vault_task import DATA_SOURCE, LOOK, VaultEnv, env_yaml

    reset, step = VaultEnv.reset, VaultEnv.step

    def forced_reset(env, row):
        env.right = row["extra_info"]["index"] == 0
        return reset(env, row)

    def forced_step(env, action):
        wrong = f"{(int(env.code) + 1) % 10_000:04d}"
        return step(env, LOOK if env.turn == 0 else env.code if env.right else wrong)

    monkeypatch.setattr(VaultEnv, "reset", forced_reset)
    monkeypatch.setattr(VaultEnv, "step", forced_step)
    path = Path(__file__).resolve().parents[2] / "examples" / "agent" / "vault_agent.py"
    monkeypatch.setattr(endpoint_rollout.multi_turn, "agent",
                        load_agent(OmegaConf.create({"agent_path": str(path), "agent_name": "run_episode"})))
    extra = [{"split": "train", "index": i} for i in range(len(QUESTIONS))]
    rows = np.array([{"data_source": DATA_SOURCE, "agent_name": None, "extra_info": e,
                      "prompt": [{"role": "user", "content": q}]} for q, e in zip(QUESTIONS, extra)], dtype=object)
    prompts = make_prompts(tiny_tokenizer, QUESTIONS, agent_kwargs=rows, data_source=np.array([DATA_SOURCE] * 3),
                           reward_model=np.array([{"ground_truth": "opened"}] * 3), extra_info=np.array(extra))
    output = endpoint_rollout.generate_sequences(prompts)

    episodes = output.non_tensor_batch["episode"]
    n = len(episodes) // len(QUESTIONS)
    judged = [e["ended"] == "agent_done" for e in episodes]  # the others' turns were cut by the length limit
    assert all(e["num_turns"] == 2 for e, j in zip(episodes, judged) if j)  # the look, the answer
    assert sum(judged[:n]) >= 2 and sum(judged[n:]) >= 2, [e["ended"] for e in episodes]
    scores = NaiveRewardManager(tiny_tokenizer, 0, timeout_s=None)(output).sum(-1).tolist()
    assert scores == [float(key < n and judged[key]) for key in range(len(episodes))]

    (tmp_path / "envs.yaml").write_text(env_yaml("reset_every_turn"))
    monkeypatch.setattr(endpoint_rollout.multi_turn.loop, "envs", load_envs(str(tmp_path / "envs.yaml")))
    output = endpoint_rollout.generate_sequences(prompts)
    assert sum(e["ended"] == "agent_done" for e in output.non_tensor_batch["episode"][:n]) >= 2
    assert NaiveRewardManager(tiny_tokenizer, 0, timeout_s=None)(output).sum() == 0


def test_an_agent_that_raises_or_never_calls_stops_the_run_naming_it(endpoint_rollout, tiny_tokenizer, monkeypatch):
    """Issue 53: every episode failed in the agent gives no token to train on (zero loss, zero gradient): the
    rollout stops with the agent's own error and line, or with what a silent agent must do; a share the user
    accepts (`max_failed_share`) lets the same episodes through, each ended as it failed."""
    from hflow.agent.failures import AgentFailureError
    from hflow.utils.errors import UserError

    def raises(base_url, episode_id, row):
        raise ValueError(f"my agent has no tool for {row['data_source']}")

    def never_calls(base_url, episode_id, row):  # e.g. talks to another URL, or gives up at once
        return 1.0

    prompts, key = prompts_with_rows(tiny_tokenizer), "actor_rollout_ref.rollout.multi_turn.endpoint"
    monkeypatch.setattr(endpoint_rollout.multi_turn, "agent", raises)
    with pytest.raises(AgentFailureError) as error:
        endpoint_rollout.generate_sequences(prompts)
    assert isinstance(error.value, UserError)  # the entry point prints the message alone (hflow: error:)
    line = raises.__code__.co_firstlineno + 1
    for words in (f"{key}: 12 of 12 episodes of this rollout failed", f"{key}.max_failed_share=0.5",
                  "12 raised in the agent function run_episode of", "the first (sample 0 of this batch): ValueError: "
                  f"my agent has no tool for test ({__file__} line {line})", "raise max_failed_share"):
        assert words in str(error.value), (words, str(error.value))

    monkeypatch.setattr(endpoint_rollout.multi_turn, "agent", never_calls)
    with pytest.raises(AgentFailureError) as error:
        endpoint_rollout.generate_sequences(prompts)
    for words in ("12 of 12 episodes", "12 ended without a sampled turn", "base_url", "X-Episode-Id"):
        assert words in str(error.value), (words, str(error.value))

    monkeypatch.setitem(endpoint_rollout.multi_turn.endpoint, "max_failed_share", 1.0)
    episodes = endpoint_rollout.generate_sequences(prompts).non_tensor_batch["episode"]
    assert [(e["ended"], e["num_turns"]) for e in episodes] == [("agent_done", 0)] * 12


def test_an_endpoint_port_in_use_in_the_worker_is_a_user_error_naming_the_key():
    """Taken after preflight tried it (another run started): the worker's error is the user's, one sentence."""
    import socket

    from hflow.agent.endpoint import EndpointServer
    from hflow.utils.errors import ConfigError

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"multi_turn\.endpoint\.port={port}: the agent endpoint cannot listen on "
                                              rf"127\.0\.0\.1:{port} .*endpoint\.port=0"):
            EndpointServer(None, "127.0.0.1", port)
