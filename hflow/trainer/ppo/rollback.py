"""The health watch in the training loop (`trainer.health`): the state each step starts from is kept, and on
a trigger of the watch (`hflow.trainer.ppo.health`) the actor and critic go back to the last healthy one
and the remedy applies. Beside the watch, not in it, so that preflight's checks of the watch's settings do
not import the workers."""

from __future__ import annotations

from pathlib import Path

from hflow.trainer.ppo.health import HealthWatch, UnhealthyRun
from hflow.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, FSDPModelHolder

__all__ = ["HealthRollback"]


class HealthRollback:
    """The watch in the training loop: keeps the state each step starts from, checks the step's metrics,
    and on a trigger puts the actor (and critic) back to the last healthy state and applies the remedy.

    `snapshot=memory`: the workers copy their state to host memory at each step's start (a candidate
    that becomes the last healthy state when the step passes). `snapshot=checkpoint`: the last healthy
    state is the newest saved step that a healthy step followed (the trainer reports its saves here).
    """

    def __init__(self, cfg, log_dir: str | Path, actor_wg, critic_wg, kl_ctrl, checkpoints, rollouts):
        self.cfg = cfg
        self.watch = HealthWatch(cfg, log_dir)
        self.actor_wg, self.critic_wg, self.kl_ctrl = actor_wg, critic_wg, kl_ctrl
        self.checkpoints = checkpoints  # StepCheckpoints: where snapshot=checkpoint restores from
        self.rollouts = rollouts  # told when the weights were put back (split placement streams them again)
        self._driver_snapshots: dict[str, dict] = {}  # the driver's share of the candidate / healthy state
        self._healthy_checkpoint: int | None = None  # snapshot=checkpoint: the newest saved step a healthy step followed
        self._unconfirmed_checkpoint: int | None = None

    def _trainable_groups(self) -> list:
        return [self.actor_wg] + ([self.critic_wg] if self.critic_wg is not None else [])

    def _driver_state(self) -> dict:
        # policy_version: which batches in flight a restore of this state keeps (async_steps >= 1)
        return {"kl_ctrl": getattr(self.kl_ctrl, "value", None), "policy_version": self.rollouts.version}

    def keep_step_start(self) -> None:
        """snapshot=memory: copy the state this step starts from to host memory (a candidate that becomes
        the last healthy state if the step passes)."""
        if self.cfg.snapshot != "memory":
            return
        for wg in self._trainable_groups():
            wg.call(FSDPModelHolder.snapshot_state)
        self._driver_snapshots["candidate"] = self._driver_state()

    def check_step(self, step: int, metrics: dict[str, float], tracker) -> bool:
        """Check the step's metrics; on a trigger restore the last healthy state and apply the remedy, or
        stop with the report (logged to `tracker` first). Adds `health/*` to `metrics`; returns whether the
        step was rolled back."""
        health = self.watch
        trigger = health.check(step, metrics)
        if trigger is None:
            health.passed(step, metrics)
            self._step_was_healthy(step)
            metrics.update(health.metrics(triggered=False))
            return False
        health.failed(trigger, metrics)
        stop = health.must_stop()
        restored, in_flight = self._restore_healthy_state()
        if restored is None:
            stop = True
        else:
            health.rolled_back()
            metrics.update(in_flight)
        self.apply_factors()
        report = health.write_report(stopped=stop)
        metrics.update(health.metrics(triggered=True))
        if stop:
            tracker.log(metrics, step=step)
            tracker.close()
            why = ("trainer.health.remedy=stop" if self.cfg.remedy == "stop" else
                   "no healthy checkpoint to restore" if restored is None else
                   f"{health.rollbacks_in_a_row} rollbacks in a row (trainer.health.max_rollbacks)")
            raise UnhealthyRun(f"{trigger.describe()}; stopping ({why}). The report with the metrics around it: "
                               f"{report}" + ("" if restored is None else f"; the weights were restored to {restored}"))
        kept, dropped = int(in_flight["health/in_flight_kept"]), int(in_flight["health/in_flight_dropped"])
        print(f"{trigger.describe()}; restored {restored}, remedy {self.cfg.remedy} "
              f"(lr x{health.lr_factor:g}, clip x{health.clip_factor:g}); report: {report}"
              + (f"; batches in flight: {kept} kept (sampled by the restored weights or older ones), "
                 f"{dropped} dropped (sampled by weights the rollback discards)" if kept or dropped else ""))
        return True

    def apply_factors(self) -> None:
        """The remedies so far, on the workers: learning rates (actor and critic) and the actor's clip."""
        self.actor_wg.call(FSDPModelHolder.set_health_factors, self.watch.lr_factor, self.watch.clip_factor)
        if self.critic_wg is not None:
            self.critic_wg.call(FSDPModelHolder.set_health_factors, self.watch.lr_factor, 1.0)

    def _step_was_healthy(self, step: int) -> None:
        if self.cfg.snapshot == "memory":
            for wg in self._trainable_groups():
                wg.call(FSDPModelHolder.commit_snapshot)
            self._driver_snapshots["healthy"] = self._driver_snapshots.pop("candidate")
        elif self._unconfirmed_checkpoint == step - 1:  # the saved state started a healthy step
            self._healthy_checkpoint = self._unconfirmed_checkpoint

    def _restore_healthy_state(self) -> tuple[str | None, dict[str, float]]:
        """Put the actor (and critic) back to the last healthy state: (where from, what became of the batches in
        flight), or (None, {}) when there is none to restore. The data loader is not rewound: the batches
        since are skipped."""
        if self.cfg.snapshot == "memory":
            # before any step passed, the state this run (re)started from
            slot = "healthy" if "healthy" in self._driver_snapshots else "candidate"
            for wg in self._trainable_groups():
                wg.call(FSDPModelHolder.restore_snapshot, slot)
            driver, where = self._driver_snapshots[slot], "the start of the last healthy step (host memory)"
        else:
            if self._healthy_checkpoint is None:
                return None, {}
            step_dir = self.checkpoints.step_dir(self._healthy_checkpoint)
            self.actor_wg.call(ActorRolloutRefWorker.load_checkpoint, str(step_dir / "actor"))
            if self.critic_wg is not None:
                self.critic_wg.call(CriticWorker.load_checkpoint, str(step_dir / "critic"))
            driver, where = self.checkpoints.load_driver_state(step_dir), str(step_dir)
        if self.kl_ctrl is not None and driver.get("kl_ctrl") is not None:
            self.kl_ctrl.value = driver["kl_ctrl"]
        # a checkpoint's state is older than the weights of any batch in flight (its version is not kept)
        in_flight = self.rollouts.weights_restored(driver.get("policy_version"))
        return where, in_flight

    # ---- checkpoints (the trainer reports its saves and its resume)

    def saved(self, step: int, healthy: bool) -> None:
        """A checkpoint of `step` was saved; `healthy`: its state is one the watch already trusts (just restored)."""
        if healthy:
            self._healthy_checkpoint = step
        else:
            self._unconfirmed_checkpoint = step

    def resumed(self, step: int, state: dict | None) -> None:
        """The run resumed from the checkpoint of `step`; `state` is the watch's saved state (the remedies
        so far stay in force)."""
        self._unconfirmed_checkpoint = step
        if state is not None:
            self.watch.load_state_dict(state)
            self.apply_factors()

    def state_dict(self) -> dict:
        return self.watch.state_dict()
