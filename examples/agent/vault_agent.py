"""An external agent for the built-in stateful task (`hflow/tasks/vault_task.py`), with the `openai` client.

The agent owns the episode's environment, as any agent outside hflow owns its world: it builds a `VaultEnv`
(with the config the run gave the row's environment, `row["env"]`: the task's, or a control's), sends the
prompt to the policy through hflow's endpoint, steps the environment with each reply and sends its
observation back as a user message, until the environment ends the episode. It returns the environment's
verdict: ``{"reward": the step rewards' sum, "opened": ..., "looked": ...}``. hflow keeps the keys other than
``reward`` in the episode's info, where an environment of its own loop leaves its step's info, so the
task's scorer (`hflow/reward/score/vault.py`: 1.0 when an info says ``opened: true``) reads it unchanged.

    scripts/train.sh algorithm.adv_estimator=grpo data.builtin_task=vault \\
        actor_rollout_ref.rollout.multi_turn.endpoint.enable=true \\
        actor_rollout_ref.rollout.multi_turn.endpoint.agent_path=$PWD/examples/agent/vault_agent.py

(`data.builtin_task=vault_reset_every_turn` / `vault_shuffled` run a control the same way.)
"""

import threading

import openai

from hflow.tasks.vault_task import VaultEnv

MAX_TURNS = 3  # a guard, as the task's multi_turn.max_assistant_turns: the environment ends the episode at turn 2
_SHARED: dict = {}  # the endpoint's client (one connection pool for the step's episodes: a client takes ~50 ms to make)
_LOCK = threading.Lock()


def client(base_url: str) -> openai.OpenAI:
    with _LOCK:
        if _SHARED.get("base_url") != base_url:  # a new endpoint (each generation serves on its own port)
            _SHARED.update(base_url=base_url, client=openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0))
        return _SHARED["client"]


def run_episode(base_url: str, episode_id: str, row: dict) -> dict:
    """One vault episode of `row` (its `prompt`, the `tools` its prompt was rendered with, its `extra_info`,
    its environment's entry `env`)."""
    policy, episode = client(base_url), {"X-Episode-Id": episode_id}
    env = VaultEnv((row.get("env") or {}).get("config"))
    env.reset({"data_source": row.get("data_source"), "extra_info": row.get("extra_info")})
    messages = list(row["prompt"])
    total, verdict = 0.0, {}
    try:
        for _ in range(MAX_TURNS):
            try:
                reply = policy.chat.completions.create(model="policy", messages=messages, tools=row["tools"],
                                                       extra_headers=episode)
            except openai.BadRequestError as err:  # the observation would not fit in the response budget
                return {"reward": total, **verdict, "stopped": err.code}
            choice = reply.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))  # re-sent as returned
            if choice.finish_reason == "length":  # cut by the budget: no answer to judge
                break
            observation, reward, done, verdict = env.step(choice.message.content or "")
            total += reward
            if done:
                break
            messages.append({"role": "user", "content": observation})
    finally:
        env.close()
    return {"reward": total, **verdict}
