"""The keys whose null means "by the device", resolved once by the trainer before preflight and printed at
start: on a GPU, remove-padding and token-budget micro-batches with the largest budget of
`GPU_TOKEN_BUDGETS` for which the memory plan fits the log-prob and update passes; on CPU the old
behaviour (padded micro-batches counted in sequences). `hflow.workers.config.resolve_device_defaults`
writes the values; this module only picks the GPU's token budget.

    device defaults (cuda, 80.00 GiB): actor_rollout_ref.model.use_remove_padding=true, ..., ppo_max_token_len_per_gpu=24576
"""

from __future__ import annotations

from omegaconf import DictConfig, open_dict

from hflow.trainer.memory.facts import GIB
from hflow.utils.errors import ConfigError
from hflow.workers.config import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGETS, resolve_device_defaults

# The phases whose size the actor's token budget sets (the critic has budgets of its own; generation and the
# weight sync do not depend on it).
BUDGET_PHASES = ("old log-prob", "ref log-prob", "actor update")


def plan_token_budget(config: DictConfig, target: str, device_bytes: float | None = None) -> tuple[int, str]:
    """(budget, why): the largest of GPU_TOKEN_BUDGETS (at least one sequence long) whose passes fit in the
    memory plan of `config` on `target` with devices of `device_bytes` (None: this machine's, or
    `trainer.device_memory_gb`); the smallest when none does (the plan's summary then says what else to change)."""
    from hflow.trainer.memory.plan import plan_memory

    seq = int(config.data.max_prompt_length) + int(config.data.max_response_length)
    budgets = [b for b in GPU_TOKEN_BUDGETS if b >= seq] or [seq]
    for budget in budgets:
        trial = config.copy()
        with open_dict(trial):
            resolve_device_defaults(trial.actor_rollout_ref, True, budget, critic=trial.get("critic"))
        plan = plan_memory(trial, target, device_bytes)
        over = [p for p in plan.phases if p.name in BUDGET_PHASES and p.total > plan.device_bytes]
        if not over:
            return budget, f"the memory plan fits it in {plan.device_bytes / GIB:.2f} GiB"
    return budgets[-1], (f"the smallest tried: {over[0].name} does not fit in {plan.device_bytes / GIB:.2f} GiB "
                         "even so (see the memory plan)")


def resolve_for_run(config: DictConfig, target: str | None = None, device_bytes: float | None = None) -> list[str]:
    """Fill the null "by the device" keys of a composed trainer config in place; returns the notes printed."""
    from hflow.utils import device

    target = target or ("cuda" if device.is_cuda() else "cpu")
    arr = config.actor_rollout_ref
    budget, why = None, ""
    if target == "cuda" and arr.actor.ppo_max_token_len_per_gpu is None:
        if config.trainer.memory_plan == "off":
            why = f"trainer.memory_plan=off: {CPU_TOKEN_BUDGET}"
        else:
            try:
                budget, why = plan_token_budget(config, target, device_bytes)
            except (ConfigError, RuntimeError) as err:  # e.g. a model path preflight will name
                why = f"no memory plan ({err}): {CPU_TOKEN_BUDGET}"
    with open_dict(config):
        notes = resolve_device_defaults(arr, target == "cuda", budget, critic=config.get("critic"))
    if notes:
        line = f"device defaults ({target}): " + ", ".join(notes) + (f" ({why})" if why else "")
        print(line)
    return notes

