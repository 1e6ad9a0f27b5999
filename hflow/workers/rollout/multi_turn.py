"""Multi-turn generation for either engine: the agent loop of `hflow.agent` and its rollout output.

With `rollout.multi_turn.enable`, `generate_sequences` runs one episode per sample (prompt-major, n per
prompt) instead of one response, and the output keeps the rollout contract of
`hflow.workers.rollout.base` with these differences:

    responses          the whole episode after the prompt: sampled turns and tool messages, right-padded
    attention_mask     1 over the whole episode (not only up to the first EOS: each turn ends with one)
    response_mask      (B·n, L) 1 on sampled tokens, 0 on tool tokens and padding: no loss, entropy, KL
                       or advantage reaches a tool token
    rollout_log_probs  sampler log-probs on sampled tokens, 0.0 elsewhere
    rollout_versions   (when weights can change during generation) the policy version that sampled each
                       token, -1 on tool tokens and padding
    turn_rewards       (B·n, L) float32: the step/turn rewards of tools, environments and simulated users,
                       each on the last sampled token of the turn it judges (0 elsewhere); the trainer
                       trains on them only with `algorithm.turn_rewards` other than `ignore`
    episode            (non-tensor) the episode: messages, tool calls with results, turns, how it ended

and `meta_info["metrics"]` carries the `agent/*` metrics.

With `multi_turn.endpoint.enable` the episodes come from the user's agent function instead of hflow's loop
(`generate_external`, `hflow.agent.endpoint`): the same engine samples the turns, the same output is
assembled from the ids the endpoint recorded. The agent owns its environment: it gets the row's entry of
`multi_turn.env_config_path` (``row["env"]``) to build it, and reports its verdict in its return value.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from hflow.agent.config import load_agent
from hflow.agent.endpoint import Endpoint, run_external_agents
from hflow.agent.env import load_envs
from hflow.agent.interactions import load_interactions
from hflow.agent.loop import AgentLoop, Episode, TurnEngine, agent_metrics
from hflow.agent.parsers import get_parser
from hflow.agent.tool_config import builtin_tools, load_tools, tool_schemas
from hflow.protocol import DataProto
from hflow.utils.torch_functional import pad_2d_list_to_length
from hflow.workers.rollout.base import SamplingSettings, assemble_rollout_output, pad_log_probs, prompt_token_ids

__all__ = ["MultiTurnRollout", "assemble_episodes", "load_rollout_tools"]


def load_rollout_tools(multi_turn: Any) -> dict:
    """The tools of `rollout.multi_turn`: `tool_config_path`'s, or the built-in calculator when unset."""
    return load_tools(multi_turn.tool_config_path) if multi_turn.tool_config_path else builtin_tools(["calculator"])


class MultiTurnRollout:
    """The agent loop for one rollout engine: built from `rollout.multi_turn`, run by `generate`."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        multi_turn = config.multi_turn
        self.tokenizer = tokenizer
        self.response_length = int(config.response_length)
        tools = load_rollout_tools(multi_turn)
        envs = load_envs(multi_turn.env_config_path) if multi_turn.env_config_path else None
        interactions = (load_interactions(multi_turn.interaction_config_path)
                        if multi_turn.interaction_config_path else None)
        self.loop = AgentLoop(tokenizer, multi_turn, tools, get_parser(str(multi_turn.format)), self.response_length,
                              tool_schemas(tools), envs=envs, interactions=interactions)
        self.tool_schemas = tool_schemas(tools)
        endpoint = multi_turn.get("endpoint")
        self.endpoint = endpoint if endpoint is not None and endpoint.enable else None
        self.agent = load_agent(endpoint) if self.endpoint is not None else None

    def _rows(self, prompts: DataProto, n: int) -> tuple[list, list | None, list | None]:
        """Per sample (prompt-major, n each): the prompt ids, the tools' kwargs and the row (agent_kwargs)."""
        ids = [row for row in prompt_token_ids(prompts) for _ in range(n)]
        kwargs = prompts.non_tensor_batch.get("tools_kwargs")
        tools_kwargs = [_as_dict(k, i) for i, k in enumerate(kwargs) for _ in range(n)] if kwargs is not None else None
        agent_kwargs = prompts.non_tensor_batch.get("agent_kwargs")  # the rows' data_source, extra_info, ...
        rows = [_as_dict(k, i, "agent_kwargs") for i, k in enumerate(agent_kwargs) for _ in range(n)] \
            if agent_kwargs is not None else None
        return ids, tools_kwargs, rows

    def generate_external(self, prompts: DataProto, settings: SamplingSettings, engine: TurnEngine,
                          calculate_log_probs: bool, set_sampling: Callable[[int, dict], None]) -> DataProto:
        """`settings.n` episodes per prompt, each run by the user's agent function through the endpoint;
        `set_sampling(key, sampling)` sets a request's temperature / top_p / seed on `engine`."""
        n = settings.n
        ids, tools_kwargs, rows = self._rows(prompts, n)
        eos = [int(t) for t in np.atleast_1d(prompts.meta_info["eos_token_id"])]
        endpoint = Endpoint(self.tokenizer, self.loop.parser, eos, prompts.batch["input_ids"].shape[1],
                            self.response_length, want_log_probs=calculate_log_probs)
        raw = prompts.non_tensor_batch.get("raw_prompt")
        agent_rows = []
        for key, prompt in enumerate(ids):
            row = dict(rows[key]) if rows is not None else {}
            if row.get("prompt") is None and raw is not None:
                row["prompt"] = list(raw[key // n])
            episode = Episode(prompt_ids=list(prompt), tools_kwargs=tools_kwargs[key] if tools_kwargs else {}, row=row)
            endpoint.open(episode, key)
            agent_rows.append({**row, "index": key, "prompt_ids": list(prompt), "tools": self.tool_schemas,
                               "tools_kwargs": episode.tools_kwargs, "env": self._env_entry(row, key)})
        started = time.perf_counter()
        episodes = run_external_agents(endpoint, engine, self.agent, agent_rows, set_sampling, self.endpoint)
        output = assemble_episodes(prompts, episodes, n, prompts.meta_info["pad_token_id"], calculate_log_probs,
                                   self.response_length)
        metrics = agent_metrics(episodes, time.perf_counter() - started)
        for code, count in endpoint.refused.items():
            metrics[f"agent/endpoint_refused/{code}"] = count / max(len(episodes), 1)
        output.meta_info["metrics"] = metrics
        return output

    def _env_entry(self, row: Mapping[str, Any], key: int) -> dict | None:
        """The row's environment in `multi_turn.env_config_path` ({name, config}), or None: an external agent
        owns its environment, and builds the one the run configured (a control's, say) from this entry."""
        if self.loop.envs is None:
            return None
        spec = self.loop.envs.for_row(row, f"sample {key} of this batch (data_source {row.get('data_source')!r})")
        return {"name": spec.name, "config": dict(spec.config)} if spec is not None else None

    def generate(
        self,
        prompts: DataProto,
        settings: SamplingSettings,
        engine: TurnEngine,
        calculate_log_probs: bool,
        agree: Callable[[list], list] | None = None,
        all_done: Callable[[bool], bool] | None = None,
    ) -> DataProto:
        """`settings.n` episodes per prompt on `engine` (which samples one turn per request)."""
        n = settings.n
        ids, tools_kwargs, rows = self._rows(prompts, n)
        eos = prompts.meta_info["eos_token_id"]
        started = time.perf_counter()
        episodes = self.loop.run(engine, ids, eos_token_ids=[int(t) for t in np.atleast_1d(eos)],
                                 tools_kwargs=tools_kwargs, agree=agree, all_done=all_done, rows=rows)
        output = assemble_episodes(prompts, episodes, n, prompts.meta_info["pad_token_id"], calculate_log_probs,
                                   self.response_length)
        output.meta_info["metrics"] = agent_metrics(episodes, time.perf_counter() - started)
        return output


def assemble_episodes(prompts: DataProto, episodes: list[Episode], n: int, pad_token_id: int,
                      calculate_log_probs: bool, width: int) -> DataProto:
    """The rollout output of `episodes` (prompt-major, n per prompt of `prompts`), `width` tokens wide."""
    responses = pad_2d_list_to_length([e.response_ids for e in episodes], pad_token_id, max_length=width)
    lengths = torch.tensor([len(e.response_ids) for e in episodes])
    attention = (torch.arange(width)[None, :] < lengths[:, None]).long()
    log_probs = pad_log_probs([e.log_probs for e in episodes], width) if calculate_log_probs else None
    output = assemble_rollout_output(prompts, responses, n, log_probs, response_attention_mask=attention)
    output.batch["response_mask"] = pad_2d_list_to_length([e.loss_mask for e in episodes], 0, max_length=width)
    output.batch["turn_rewards"] = torch.tensor([e.token_rewards(width) for e in episodes], dtype=torch.float32)
    if any(v >= 0 for e in episodes for v in e.versions):  # the engine recorded them (weight updates in flight)
        output.batch["rollout_versions"] = pad_2d_list_to_length([e.versions for e in episodes], -1, max_length=width)
    output.non_tensor_batch["episode"] = np.array([e.summary() for e in episodes], dtype=object)
    return output


def _as_dict(value: Any, row: int, key: str = "tools_kwargs") -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        what = ("give a mapping of tool name -> {create_kwargs: {...}, execute_kwargs: {...}} (or leave it out)"
                if key == "tools_kwargs" else "the dataset makes it a mapping (data_source, extra_info, ...)")
        raise ValueError(f"{key} of prompt {row} in this batch is a {type(value).__name__}; {what}")
    return value
