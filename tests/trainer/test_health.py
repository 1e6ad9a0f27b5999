"""The health watch (`trainer.health`), by fault injection on the built-in task.

Each fault is the kind that ruins real runs: one update at a learning rate x1000 (the model collapses to
one-token answers, entropy 0, or to noise, entropy near the vocabulary's, as the CPU's float kernels
decide; either way every group's advantage is 0), NaN logits in one update, and a reward that
scores every response 0 for three steps (a broken reward function). Without the watch the first one ends
the run at 0.0 (the control below); with it each fault is caught, the last healthy state is restored and
the run still ends >= 0.8. With no fault a run with the watch on is identical, metric for metric and step
for step, to one with it off: the snapshots change nothing (shown on the steps before the lr spike).

The runs are in-process on the local backend (one rank, FSDP2, HF generation) to keep them short; the
watch itself lives in the driver and the workers' snapshot methods, the same on every backend.
"""

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from hflow import CONFIG_DIR
from hflow.config_schema import ConfigError
from hflow.trainer.config import default_config
from hflow.trainer.main_ppo import run_ppo
from hflow.trainer.ppo.faults import faults_at, poison_scores
from hflow.trainer.ppo.health import HealthWatch, UnhealthyRun, check_health_config, zero_advantage_group_frac
from hflow.workers.fsdp.snapshot import HostSnapshot
from tests.trainer.learning import VAL_KEY

STEPS = 7
FAULT_STEP = 4  # the built-in model has learned the task by then (greedy >= 0.9)
# detectors on for every run here; a healthy run never trips them (the identity test shows it)
WATCH = ("trainer.health.enable=true", "trainer.health.entropy_min=0.02", "trainer.health.entropy_max=2.0",
         "trainer.health.zero_adv_group_frac=1.0")


def _run(tmp_path, name, *overrides, steps=STEPS):
    run_dir = tmp_path / name
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            "algorithm.adv_estimator=grpo", "trainer.backend=local", "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.name=hf", f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}",
            "trainer.val_before_train=false", f"trainer.log_dir={run_dir / 'logs'}",
            f"trainer.default_local_dir={run_dir / 'ckpt'}", *overrides])
    run_ppo(config)
    return [json.loads(line) for line in open(run_dir / "logs" / "metrics.jsonl")]


def _final_score(records):
    return [r[VAL_KEY] for r in records if VAL_KEY in r][-1]


def _triggers(records):
    return [r["step"] for r in records if r.get("health/triggered") == 1.0]


def _comparable(record):
    return {k: v for k, v in record.items() if not k.startswith(("health/", "timing", "perf/"))}


@pytest.fixture(scope="module")
def lr_spike(tmp_path_factory):
    """One update at a learning rate x1000 at FAULT_STEP, without the watch (the control) and with it."""
    tmp_path = tmp_path_factory.mktemp("lr_spike")
    fault = f"trainer.health.inject=[{{step: {FAULT_STEP}, kind: lr_scale, value: 1000}}]"
    control = _run(tmp_path, "control", fault, steps=FAULT_STEP + 1)  # no watch: the run collapses and never recovers
    watched = _run(tmp_path, "watched", fault, *WATCH, "trainer.health.remedy=lr_scale")
    return tmp_path, control, watched


@pytest.mark.slow  # two training runs (the module's lr-spike runs)
def test_with_no_fault_the_watch_changes_nothing(lr_spike):
    """The steps before the fault of the two lr-spike runs: a healthy run with the watch on (a snapshot taken
    after every step) is the run with it off, metric for metric (two runs of their own would add ~8 steps)."""
    _, off, on = lr_spike
    off, on = off[:FAULT_STEP - 1], on[:FAULT_STEP - 1]
    assert _triggers(on) == [] and all(r["health/rollbacks"] == 0 for r in on)
    assert [r["step"] for r in off] == [r["step"] for r in on] == list(range(1, FAULT_STEP))
    for a, b in zip(off, on):
        assert _comparable(a) == _comparable(b), f"step {a['step']} differs with the watch on"


@pytest.mark.slow  # two training runs (the module's lr-spike runs)
def test_a_learning_rate_spike_is_rolled_back(lr_spike):
    tmp_path, control, watched = lr_spike
    assert _final_score(control) < 0.2, _final_score(control)
    # the step after the fault: the policy is ruined, in one of two ways depending on the CPU's float kernels
    # (AVX-512: one-token answers, entropy ~0; AVX2: noise, entropy many times the healthy step's)
    healthy, ruined = control[FAULT_STEP - 2]["actor/entropy"], control[FAULT_STEP]["actor/entropy"]
    assert ruined < 0.02 or ruined > 5 * healthy, (healthy, ruined)

    triggered = _triggers(watched)
    assert triggered and triggered[0] == FAULT_STEP + 1, triggered  # seen in the next step's samples
    assert _final_score(watched) >= 0.8, _final_score(watched)
    after = watched[triggered[-1]]  # the step after the last rollback trains at half the learning rate
    assert after["health/lr_factor"] == 0.5
    assert after["actor/lr"] == pytest.approx(0.5 * watched[0]["actor/lr"])
    report = json.loads((tmp_path / "watched" / "logs" / "health_report.json").read_text())
    assert report["triggers"][0]["detector"] in ("entropy_collapse", "entropy_blowup", "zero_advantage")
    assert not report["stopped"]


@pytest.mark.slow  # a training run
def test_nan_logits_are_rolled_back_from_the_last_healthy_checkpoint(tmp_path):
    fault = f"trainer.health.inject=[{{step: {FAULT_STEP}, kind: nan_logits}}]"
    watched = _run(tmp_path, "watched", fault, *WATCH, "trainer.health.snapshot=checkpoint", "trainer.save_freq=2")
    assert _triggers(watched) == [FAULT_STEP]
    assert watched[FAULT_STEP - 1]["actor/pg_loss"] is None  # NaN (JSON has none: null)
    assert _final_score(watched) >= 0.8, _final_score(watched)
    report = json.loads((tmp_path / "watched" / "logs" / "health_report.json").read_text())
    assert report["triggers"][0]["detector"] == "non_finite" and report["triggers"][0]["value"] == "nan"
    # the restored state was saved as the step's checkpoint: a resume never starts from the unhealthy one
    assert (tmp_path / "watched" / "ckpt" / f"global_step_{FAULT_STEP}").is_dir()


@pytest.mark.slow  # two training runs
def test_a_broken_reward_is_skipped_and_then_stops_the_run_when_it_persists(tmp_path):
    fault = f"trainer.health.inject=[{{step: {FAULT_STEP}, kind: reward, value: 0.0, steps: 3}}]"
    watched = _run(tmp_path, "watched", fault, *WATCH, "trainer.health.remedy=tighten_clip")
    assert _triggers(watched) == [FAULT_STEP, FAULT_STEP + 1, FAULT_STEP + 2]
    assert watched[-1]["health/rollbacks"] == 3 and watched[-1]["health/clip_factor"] == 0.125
    assert _final_score(watched) >= 0.8, _final_score(watched)

    # the same fault with one rollback allowed: the second trigger stops the run with its report
    with pytest.raises(UnhealthyRun, match="zero_advantage.*rollbacks in a row"):
        _run(tmp_path, "stopped", fault, *WATCH, "trainer.health.max_rollbacks=1", steps=FAULT_STEP + 2)
    report = json.loads((tmp_path / "stopped" / "logs" / "health_report.json").read_text())
    assert report["stopped"] and [t["step"] for t in report["triggers"]] == [FAULT_STEP, FAULT_STEP + 1]
    assert report["recent_steps"][-1]["training/zero_adv_group_frac"] == 1.0


# ---- the parts on their own ----------------------------------------------------------------------


def _watch(**overrides):
    cfg = default_config().trainer.health
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return HealthWatch(cfg, "/nonexistent")


def test_detectors_fire_on_their_metric_only():
    healthy = {"actor/grad_norm": 1.0, "actor/entropy": 0.5, "actor/ppo_kl": 0.001, "actor/pg_loss": 0.1,
               "training/rollout_probs_diff_max": 0.01, "response_length/clip_ratio": 0.1,
               "training/zero_adv_group_frac": 0.2}
    watch = _watch(entropy_min=0.1, entropy_max=2.0, ppo_kl_max=0.05, rollout_probs_diff_max=0.5,
                   max_length_frac=0.9, zero_adv_group_frac=1.0)
    assert watch.check(1, healthy) is None
    cases = {"actor/pg_loss": (float("nan"), "non_finite"), "actor/entropy": (0.05, "entropy_collapse"),
             "actor/ppo_kl": (-0.2, "ppo_kl"), "training/rollout_probs_diff_max": (0.9, "rollout_probs_diff"),
             "response_length/clip_ratio": (0.95, "length_pinned"), "training/zero_adv_group_frac": (1.0, "zero_advantage"),
             "critic/vf_loss": (float("inf"), "non_finite")}
    for key, (value, detector) in cases.items():
        trigger = watch.check(1, {**healthy, key: value})
        assert trigger is not None and (trigger.detector, trigger.key) == (detector, key), (key, trigger)
    blowup = watch.check(1, {**healthy, "actor/entropy": 4.6})  # noise: the other way a policy breaks
    assert (blowup.detector, blowup.key, blowup.limit) == ("entropy_blowup", "actor/entropy", 2.0)


def test_grad_norm_spike_needs_history_and_a_real_spike():
    watch = _watch()
    norms = [1.0, 1.1, 0.9, 1.05, 0.95]
    for step, norm in enumerate(norms[:4], 1):
        assert watch.check(step, {"actor/grad_norm": 100.0}) is None  # too little history to judge
        watch.passed(step, {"actor/grad_norm": norm})
    watch.passed(5, {"actor/grad_norm": norms[4]})
    assert watch.check(6, {"actor/grad_norm": 1.3}) is None
    trigger = watch.check(6, {"actor/grad_norm": 10.0})
    assert trigger.detector == "grad_norm_spike" and 1.3 < trigger.limit < 10.0
    steady = _watch()
    for step in range(1, 6):
        steady.passed(step, {"actor/grad_norm": 2.0})  # no spread at all: a 5 % floor keeps noise harmless
    assert steady.check(6, {"actor/grad_norm": 2.4}) is None and steady.check(6, {"actor/grad_norm": 3.0})


def test_rollbacks_in_a_row_and_remedies():
    watch = _watch(remedy="lr_scale", max_rollbacks=2)
    for _ in range(2):
        assert not watch.must_stop()
        watch.rolled_back()
    assert watch.must_stop() and watch.lr_factor == 0.25 and watch.clip_factor == 1.0
    watch.passed(9, {})  # a healthy step resets the count, not the factors
    assert not watch.must_stop() and watch.lr_factor == 0.25


@pytest.mark.parametrize("key,value,message", [
    ("remedy", "retry", "trainer.health.remedy"),
    ("snapshot", "disk", "trainer.health.snapshot"),
    ("inject", [{"step": 0, "kind": "reward", "value": 0}], r"inject\[0\].step"),
    ("inject", [{"step": 2, "kind": "explode"}], r"inject\[0\]"),
    ("inject", [{"step": 2, "kind": "lr_scale"}], r"inject\[0\].value"),
    # the inputs (39): each accepted before, a negative learning rate after a rollback among them
    ("lr_scale", -1.0, r"trainer.health.lr_scale must be a factor in \(0, 1\]"),
    ("clip_scale", 0.0, r"trainer.health.clip_scale must be a factor in \(0, 1\]"),
    ("zero_adv_group_frac", 50.0, r"trainer.health.zero_adv_group_frac must be a fraction in \(0, 1\]"),
    ("max_length_frac", 1.5, r"trainer.health.max_length_frac"),
    ("entropy_min", -0.1, r"trainer.health.entropy_min must be >= 0"),
    ("ppo_kl_max", -1.0, r"trainer.health.ppo_kl_max must be > 0"),
    ("rollout_probs_diff_max", 0.0, r"trainer.health.rollout_probs_diff_max"),
    ("grad_norm_zscore", 0.0, r"trainer.health.grad_norm_zscore must be > 0 or null"),
    ("entropy_max", 0.0, r"trainer.health.entropy_max must be > 0 or null"),
    ("entropy_max", 0.01, r"trainer.health.entropy_min=0.02 must be < trainer.health.entropy_max=0.01"),
])
def test_bad_health_settings_name_the_key(key, value, message):
    config = default_config()
    if key == "entropy_max":  # the band's lower end, for the lower < upper case
        config.trainer.health.entropy_min = 0.02
    setattr(config.trainer.health, key, value)
    with pytest.raises(ConfigError, match=message):
        check_health_config(config)


def test_bad_health_settings_are_reported_together():
    """remedy=lr_scale lr_scale=-1, zero_adv_group_frac=50, clip_scale=0 in one command: one error, each key named."""
    config = default_config()
    health = config.trainer.health
    health.remedy, health.lr_scale, health.zero_adv_group_frac, health.clip_scale = "lr_scale", -1.0, 50.0, 0.0
    with pytest.raises(ConfigError) as err:
        check_health_config(config)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("3 problems"), str(err.value)
    for number, key in enumerate(["lr_scale", "clip_scale", "zero_adv_group_frac"], 1):
        assert any(line.startswith(f"  {number}. trainer.health.") for line in lines), str(err.value)
        assert sum(f"trainer.health.{key} " in line for line in lines) == 1, (key, str(err.value))


def test_the_watch_refuses_what_it_cannot_restore():
    config = default_config()
    config.trainer.health.enable = True
    config.trainer.async_steps = 2  # batches in flight: kept or dropped at a rollback (test_placement_unit)
    check_health_config(config)
    config.trainer.async_steps = 0
    config.trainer.health.snapshot = "checkpoint"
    with pytest.raises(ConfigError, match="save_freq"):
        check_health_config(config)


def test_faults_poison_and_zero_advantage_groups():
    inject = [{"step": 3, "kind": "reward", "value": 0.0, "steps": 2}, {"step": 4, "kind": "nan_logits"}]
    assert [f["kind"] for f in faults_at(inject, 2)] == []
    assert [f["kind"] for f in faults_at(inject, 4)] == ["reward", "nan_logits"]
    assert faults_at(inject, 5) == []
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])  # the second: a tool token in the middle
    assert torch.equal(poison_scores(scores, mask, -1.0), torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, -1.0]]))
    advantages = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.5, 0.5], [-0.5, 0.0]])
    uids = np.array(["a", "a", "b", "b"], dtype=object)
    assert zero_advantage_group_frac(advantages, torch.ones(4, 2), uids) == 0.5
    assert zero_advantage_group_frac(advantages, torch.tensor([[1, 1], [1, 1], [0, 0], [0, 0]]), uids) == 1.0


def test_a_snapshot_restores_weights_optimizer_and_schedule_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].bias.requires_grad_(False)  # frozen: not copied, never changed
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    extra = {"ema": torch.zeros(3)}
    x = torch.randn(8, 4)

    def step():
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        extra["ema"].add_(1.0)

    snapshot = HostSnapshot(model, optimizer, scheduler, extra)
    snapshot.take()  # before the first step: no optimizer state yet
    step()
    after_one = {k: v.clone() for k, v in model.state_dict().items()}
    snapshot.restore()
    assert not optimizer.state and scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 0.1
    assert torch.equal(extra["ema"], torch.zeros(3))
    step()  # the same step again gives the same weights: nothing of the first one survived
    assert all(torch.equal(after_one[k], v) for k, v in model.state_dict().items())

    snapshot.take()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state[model[1].weight].items()}
    step()
    step()
    snapshot.restore()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(moments[k], v) for k, v in optimizer.state[model[1].weight].items())
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] == 0.05


def test_injected_faults_reach_only_their_step_without_the_hot_path_knowing():
    """faults.install wraps the trainer's step, the step's first scored batch and each actor rank's
    update_actor: a reward fault poisons the step's batch only (not DAPO's extra ones), an update fault
    scales that update's learning rate or makes its logits NaN, and is gone after its step."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from hflow.protocol import DataProto
    from hflow.trainer.ppo import faults

    class Logits(torch.nn.Module):
        def forward(self, x):
            return SimpleNamespace(logits=x * 2)

    class Worker:  # an actor rank: its update reads the learning rate and runs the model
        def __init__(self):
            self.actor_optimizer = SimpleNamespace(param_groups=[{"lr": 1.0}])
            self.actor = SimpleNamespace(actor_module=Logits())

        def update_actor(self, batch):
            lr = self.actor_optimizer.param_groups[0]["lr"]
            self.actor_optimizer.param_groups[0]["lr"] = 1.0  # the scheduler's step sets the rate again
            return lr, self.actor.actor_module(torch.ones(1)).logits

    workers = [Worker(), Worker()]

    def on_every_rank(func, data):
        return DataProto.concat([func(w, part) for w, part in zip(workers, data.chunk(len(workers)))])

    # a group of two ranks: `call` runs the named worker method as the group would
    actor_wg = SimpleNamespace(world_size=2, call=lambda method, *args: {
        "execute_with_func_generator": on_every_rank}[method.__name__](*args))
    scores = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])

    def scored(rollout, metrics, timing):
        return DataProto.from_dict({"token_level_scores": scores.clone(), "response_mask": mask}), {}

    updates = {}

    def train_step(rollout, timing):
        first = trainer.rollouts.scored(None, {}, {})[0].batch["token_level_scores"]
        extra = trainer.rollouts.scored(None, {}, {})[0].batch["token_level_scores"]  # e.g. DAPO's next batch
        if trainer.global_steps != 4:  # step 4: no update (a critic warm-up, say)
            updates[trainer.global_steps] = [w.update_actor(None) for w in workers]
        return first, extra

    inject = [{"step": 2, "kind": "reward", "value": -5.0}, {"step": 3, "kind": "lr_scale", "value": 100.0},
              {"step": 4, "kind": "nan_logits"}, {"step": 5, "kind": "nan_logits"}]
    trainer = SimpleNamespace(config=OmegaConf.create({"trainer": {"health": {"inject": inject}}}),
                              actor_rollout_wg=actor_wg, train_step=train_step,
                              rollouts=SimpleNamespace(scored=scored), global_steps=0)
    faults.install(trainer)
    steps = {}
    for step in range(1, 7):
        trainer.global_steps = step
        steps[step] = trainer.train_step(None, {})
    assert torch.equal(steps[2][0], torch.tensor([[0.0, -5.0, 0.0]])) and torch.equal(steps[2][1], scores)
    assert all(torch.equal(steps[s][0], scores) for s in (1, 3, 4, 5, 6))
    assert [lr for lr, _ in updates[3]] == [100.0, 100.0]
    assert all(lr == 1.0 for s in (1, 2, 5, 6) for lr, _ in updates[s])
    assert all(torch.isnan(logits).all() for _, logits in updates[5])
    assert all(torch.equal(logits, torch.tensor([2.0])) for s in (1, 2, 3, 6) for _, logits in updates[s])
