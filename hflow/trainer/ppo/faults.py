"""Fault injection (`trainer.health.inject`): faults on purpose, to see the health watch catch them.

Each fault is `{step: N, kind: ..., value: ..., steps: 1}` and lasts `steps` training steps from step N
(injected whether the watch is on or off):
- `reward`: every response of the step's batch scores `value` (at its last response token), as a broken
  reward would; the step trains on those scores;
- `lr_scale`: the actor's learning rate times `value`, for the step's update only;
- `nan_logits`: the actor's logits are NaN in the step's update.

Nothing on the training path knows about it: when faults are configured, `install` wraps the trainer's
step, the batch it scores, and each actor rank's `update_actor`.
"""

from __future__ import annotations

import torch

from hflow.protocol import DataProto
from hflow.single_controller.base import Worker

FAULTS = ("lr_scale", "nan_logits", "reward")


def faults_at(inject, step: int) -> list[dict]:
    """The faults of `trainer.health.inject` active at `step`."""
    return [dict(f) for f in inject or [] if f["step"] <= step < f["step"] + f.get("steps", 1)]


def poison_scores(scores: torch.Tensor, response_mask: torch.Tensor, value: float) -> torch.Tensor:
    """Fault `reward`: every response scores `value` (at its last response token), as a broken reward would."""
    poisoned = torch.zeros_like(scores)
    positions = torch.arange(scores.shape[-1], device=scores.device)
    last = (response_mask.to(torch.long) * positions).argmax(-1)
    poisoned[torch.arange(len(scores)), last] = float(value)
    return poisoned


def install(trainer) -> None:
    """Make the faults of `trainer.config.trainer.health.inject` happen at their steps (after
    `trainer.init_workers`): a `reward` fault replaces the scores of the step's batch (the first one the
    step takes: the extra batches of DAPO's dynamic sampling are not poisoned); an update fault is armed
    on every actor rank for the step and disarmed after it (a step without an update uses none)."""
    inject = trainer.config.trainer.health.inject
    actor_wg = trainer.actor_rollout_wg
    train_step, scored = trainer.train_step, trainer.rollouts.scored
    poison: dict[str, float] = {}  # the reward fault's value, until the step's batch is scored

    def faulty_scored(rollout, metrics, timing):
        batch, reward = scored(rollout, metrics, timing)
        if "value" in poison:
            batch.batch["token_level_scores"] = poison_scores(
                batch.batch["token_level_scores"], batch.batch["response_mask"], poison.pop("value"))
        return batch, reward

    def faulty_train_step(rollout, timing):
        faults = faults_at(inject, trainer.global_steps)
        for fault in faults:
            if fault["kind"] == "reward":
                poison["value"] = fault["value"]
        update_faults = [f for f in faults if f["kind"] != "reward"]
        if update_faults:
            _arm(actor_wg, update_faults[0])
        try:
            return train_step(rollout, timing)
        finally:
            poison.clear()
            if update_faults:
                _arm(actor_wg, None)

    trainer.train_step = faulty_train_step
    trainer.rollouts.scored = faulty_scored


def _arm(actor_wg, fault: dict | None) -> None:
    """Set the fault every actor rank applies to its next updates (None: none)."""
    ranks = DataProto.from_dict({"rank": torch.arange(actor_wg.world_size)}, meta_info={"fault": fault})
    actor_wg.call(Worker.execute_with_func_generator, _arm_rank, ranks)


def _arm_rank(worker, data: DataProto) -> DataProto:
    """On one actor rank: wrap `update_actor` (once) and set the fault it applies."""
    if not hasattr(worker, "injected_fault"):
        update_actor = worker.update_actor

        def faulty_update_actor(batch: DataProto) -> DataProto:
            fault = worker.injected_fault or {}
            if fault.get("kind") == "lr_scale":  # this update only: the scheduler's step sets the rate again
                for group in worker.actor_optimizer.param_groups:
                    group["lr"] *= float(fault["value"])
            hook = (worker.actor.actor_module.register_forward_hook(_nan_logits)
                    if fault.get("kind") == "nan_logits" else None)
            try:
                return update_actor(batch)
            finally:
                if hook is not None:
                    hook.remove()

        worker.update_actor = faulty_update_actor
    worker.injected_fault = data.meta_info["fault"]
    return data


def _nan_logits(module, args, output):
    """A forward hook on the actor's model: its logits become NaN."""
    output.logits = output.logits * float("nan")
    return output
