"""Preflight's sandbox check: which sandboxes a run's code tools and code rewards will use, and whether
they isolate the code (`hflow.sandbox.require_isolation`), so that a run that would execute
model-written code without isolation stops before Ray or any model starts.

- code tools: every tool of ``actor_rollout_ref.rollout.multi_turn`` (when enabled) that holds a
  sandbox (the built-in ``python`` tool, or a tool class of the user's with a ``sandbox`` attribute),
  with the sandbox its tool YAML configures (local or remote);
- code rewards: without ``custom_reward_function.path`` or ``.url``, the data's ``data.reward_fn_key``
  values that the built-in code scorer handles (`hflow.reward.score.code_exec.DATA_SOURCES`); with a
  reward file, when its text imports ``hflow.sandbox`` or the code scorer (a reward that imports it
  under another name is still refused at run time, as every unisolated run is).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hflow.config_schema import ConfigError
from hflow.sandbox import IsolationReport, LocalSandbox, Sandbox, SandboxUnavailable, require_isolation

__all__ = ["check_code_isolation", "code_sandboxes"]

_USES_SANDBOX = re.compile(r"hflow\.sandbox|code_exec")


def check_code_isolation(config: Any) -> IsolationReport:
    """Stop (`ConfigError`) when a sandbox this run uses cannot isolate code here, unless
    ``sandbox.allow_unisolated``; then it warns (every start). Each start that uses a sandbox is recorded in
    ``<trainer.log_dir>/sandbox.jsonl``."""
    try:
        report = require_isolation(code_sandboxes(config), allow_unisolated=bool(config.sandbox.allow_unisolated))
    except SandboxUnavailable as err:
        raise ConfigError(str(err)) from None
    report.record(str(config.trainer.log_dir))
    return report


def code_sandboxes(config: Any) -> dict[str, Sandbox]:
    """What in this run executes model-written code -> the sandbox it runs in."""
    found: dict[str, Sandbox] = {}
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if multi_turn.enable and multi_turn.tool_config_path is not None:  # else the built-in calculator alone
        from hflow.workers.rollout.multi_turn import load_rollout_tools

        for index, (name, tool) in enumerate(load_rollout_tools(multi_turn).items()):
            sandbox = getattr(tool, "sandbox", None)
            if isinstance(sandbox, Sandbox):
                found[f"the {name!r} tool (tools[{index}] of {multi_turn.tool_config_path})"] = sandbox
    reward = config.custom_reward_function
    if reward.url is not None:
        return found  # scored elsewhere
    if reward.path is not None:
        path = Path(str(reward.path)).expanduser()
        try:
            uses = bool(_USES_SANDBOX.search(path.read_text(encoding="utf-8", errors="replace")))
        except OSError:
            uses = False  # preflight names a missing file itself
        if uses:
            found[f"the reward function of custom_reward_function.path={reward.path} (it uses hflow.sandbox)"] = \
                LocalSandbox()
        return found
    sources = _code_data_sources(config)
    if sources:
        found[f"code rewards (data_source {', '.join(map(repr, sources))})"] = LocalSandbox()
    return found


def _code_data_sources(config: Any) -> list[str]:
    from hflow.reward.score.code_exec import DATA_SOURCES
    from hflow.utils.dataset.sources import read_schema, read_table, split_for

    key, sources = config.data.reward_fn_key, set()
    for files_key in ("data.train_files", "data.val_files"):
        files = OmegaConf.select(config, files_key)
        files = [] if files is None else [files] if isinstance(files, str) else list(files)
        for path in files:
            path = Path(str(path)).expanduser()
            split, split_key = split_for(config.data, files_key)
            try:
                if key not in read_schema(path, files_key, split, split_key).names:
                    continue
            except ValueError:
                continue  # preflight names a missing or unreadable file itself
            sources.update(read_table(path, files_key, [key], split, split_key).column(key).to_pylist())
    return sorted(sources & set(DATA_SOURCES))
