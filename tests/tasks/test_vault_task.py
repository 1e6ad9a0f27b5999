"""Tests of the built-in stateful task (hflow.tasks.vault_task): its environment, its controls' semantics,
its score, its data and its launch's bad input. The learning runs are tests/trainer/test_vault_task_learns.py.

The environment is driven here as the agent loop drives it (`reset(row)`, `step(text)` per turn, one instance
per episode); the data and the model come from QUICK_VAULT_SPEC, a seconds-long build of the same layout.
"""

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf, open_dict

from hflow import CONFIG_DIR
from hflow.agent.env import load_envs
from hflow.config_schema import ConfigError
from hflow.reward.score import default_compute_score
from hflow.tasks import vault_task as vt
from hflow.tasks.defaults import fill_builtin_defaults
from hflow.trainer.config import validate_config
from hflow.trainer.preflight import check_reward_sources

TRAIN_ROW = {"data_source": vt.DATA_SOURCE, "extra_info": {"split": "train", "index": 0, "vault": 3}}
VAL_ROW = {"data_source": vt.DATA_SOURCE, "extra_info": {"split": "val", "index": 0, "vault": 7}}


@pytest.fixture(scope="module")
def quick_assets(tmp_path_factory) -> vt.VaultAssets:
    return vt.ensure_vault_assets(tmp_path_factory.mktemp("cache"), spec=vt.QUICK_VAULT_SPEC)


def shown_code(observation: str) -> str:
    assert observation.startswith("The code is ") and observation.endswith("."), observation
    return observation[len("The code is "):-1]


def episode(env: vt.VaultEnv, row: dict, look: bool = True) -> tuple[str | None, dict]:
    """One episode as the loop plays it with a model that copies what it is shown: (shown code, last info)."""
    assert env.reset(row) is None
    if not look:
        _, reward, done, info = env.step("1234")
        assert done and reward == 0.0
        return None, info
    obs, reward, done, info = env.step("look")
    assert not done and reward == 0.0 and info == {"looked": True}
    code = shown_code(obs)
    obs, reward, done, info = env.step(f" {code}\n")  # the turn's text, around the answer
    assert done and obs is None and reward == 0.0
    return code, info


# ------------------------------------------------------------------------------------- environment


def test_the_code_is_kept_in_the_episode_and_only_there():
    envs = [vt.VaultEnv({"seed": 11}) for _ in range(3)]
    codes = []
    for env in envs:
        code, info = episode(env, TRAIN_ROW)
        assert info == {"looked": True, "opened": True}
        codes.append(code)
    assert len(set(codes)) == 3, "each episode draws its own code"
    # answering another episode's code, or at once without looking, does not open it
    env = envs[0]
    env.reset(TRAIN_ROW)
    env.step("look")
    assert env.step(codes[1])[3] == {"looked": True, "opened": False}
    env.reset(TRAIN_ROW)
    assert env.step(env.code)[3] == {"looked": False, "opened": True}  # knowing the code without looking works
    env.reset(TRAIN_ROW)
    env.step("look")
    assert env.step("look")[2:] == (True, {"looked": True, "opened": False})  # a second look is a (wrong) answer
    with pytest.raises(RuntimeError, match="before reset"):
        vt.VaultEnv({}).step("look")


def test_codes_are_reproducible_by_seed():
    def codes(seed):
        draws = vt._Draws(seed)
        return [draws.code() for _ in range(5)]
    assert codes(3) == codes(3) != codes(4)
    assert all(len(c) == 4 and c.isdigit() for c in codes(3))


def test_look_reward_is_the_look_turns_step_reward():
    env = vt.VaultEnv({"look_reward": 0.5})
    env.reset(TRAIN_ROW)
    assert env.step("look")[1] == 0.5
    assert env.step(env.code)[1] == 0.0  # the outcome is the score's, not a step reward
    env.reset(TRAIN_ROW)
    assert env.step("1234")[1] == 0.0  # no reward for answering at once


def test_control_reset_every_turn_forgets_the_code_between_turns():
    env = vt.VaultEnv({"control": "reset_every_turn", "seed": 5})
    results = [episode(env, TRAIN_ROW)[1] for _ in range(50)]
    assert not any(r["opened"] for r in results), "what was shown cannot be the answer"
    # validation rows always get the real environment
    assert all(episode(env, VAL_ROW)[1]["opened"] for _ in range(5))


def test_control_shuffled_shows_another_episodes_code():
    env = vt.VaultEnv({"control": "shuffled", "seed": 6})
    previous = None
    for _ in range(50):
        env.reset(TRAIN_ROW)
        own = env.code
        shown = shown_code(env.step("look")[0])
        assert shown != own
        if previous is not None:
            assert shown == previous, "the code shown is the previous episode's"
        assert env.step(shown)[3] == {"looked": True, "opened": False}
        previous = own
    assert all(episode(vt.VaultEnv({"control": "shuffled"}), VAL_ROW)[1]["opened"] for _ in range(5))


@pytest.mark.parametrize("config,message", [
    ({"controll": "shuffled"}, r"unknown VaultEnv config key\(s\) \['controll'\]"),
    ({"control": "forget"}, r"control='forget'; choose one of \['none', 'reset_every_turn', 'shuffled'\]"),
    ({"look_reward": "1"}, r"look_reward='1'; give a number"),
    ({"seed": 1.5}, r"seed=1.5; give an integer"),
])
def test_bad_env_config_is_named(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        vt.VaultEnv(config)
    path = tmp_path / "envs.yaml"
    path.write_text(vt.env_yaml("none").replace("config: {control: none}", f"config: {config}"))
    with pytest.raises(ConfigError, match=r"envs\[0\]: VaultEnv\(config\) failed .*fix .*envs\[0\]\.config"):
        load_envs(str(path))


# ------------------------------------------------------------------------------------- score, data


def test_score_is_the_environments_verdict():
    def score(infos):
        extra = {"split": "train", "episode": {"info": infos, "messages": []}}
        return default_compute_score(vt.DATA_SOURCE, "4821", "opened", extra)
    assert score([{"looked": True}, {"looked": True, "opened": True}]) == 1.0
    assert score([{"looked": True}, {"looked": True, "opened": False}]) == 0.0
    assert score([]) == 0.0  # ended before the environment judged an answer
    assert default_compute_score(vt.DATA_SOURCE, "opened", "opened", {"split": "val"}) == 0.0  # no episode


def test_data_and_env_files(quick_assets):
    train = pq.read_table(quick_assets.train_file).to_pylist()
    val = pq.read_table(quick_assets.val_file).to_pylist()
    assert (len(train), len(val)) == (40, 20)
    assert {r["extra_info"]["vault"] for r in train}.isdisjoint(r["extra_info"]["vault"] for r in val)
    row = val[0]
    assert row["data_source"] == vt.DATA_SOURCE and row["extra_info"]["split"] == "val"
    assert row["prompt"] == [{"role": "user", "content": f"Open vault {row['extra_info']['vault']}."}]
    for control in vt.CONTROLS:
        spec = load_envs(quick_assets.env_config(control)).for_row(row, "row 0")
        assert spec.name == "vault" and spec.make().control == control


# ------------------------------------------------------------------------------------- launch


def _ppo_config(**data):
    config = validate_config(OmegaConf.load(f"{CONFIG_DIR}/ppo_trainer.yaml"))
    with open_dict(config):
        for key, value in data.items():
            OmegaConf.update(config, key, value)
    return config


@pytest.mark.parametrize("keys,message", [
    ({"data.builtin_task": "vault2"}, r"data.builtin_task='vault2'; choose one of \['vault', 'vault_reset_every_turn'"),
    ({"data.builtin_task": "vault", "data.train_files": "x.parquet"}, r"brings its own data and model, but "
     r"data.train_files is given"),
])
def test_bad_builtin_task_stops_before_any_build(keys, message, monkeypatch):
    monkeypatch.setattr(vt, "ensure_vault_assets", lambda *a, **k: pytest.fail("built assets for a bad config"))
    with pytest.raises(ConfigError, match=message):
        fill_builtin_defaults(_ppo_config(**keys))


def test_builtin_task_sets_multi_turn_and_the_controls_env_file(quick_assets, monkeypatch):
    monkeypatch.setattr(vt, "ensure_vault_assets", lambda *a, **k: quick_assets)
    config = _ppo_config(**{"data.builtin_task": "vault_shuffled"})
    fill_builtin_defaults(config)
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable and multi_turn.env_config_path == quick_assets.env_config("shuffled")
    assert config.data.train_files == quick_assets.train_file
    assert config.actor_rollout_ref.actor.optim.lr == 5.0e-4  # builtin_vault_task.yaml
    with pytest.raises(ConfigError, match="multi_turn.enable=false is given"):
        fill_builtin_defaults(_ppo_config(**{"data.builtin_task": "vault",
                                             "actor_rollout_ref.rollout.multi_turn.enable": False}),
                              frozenset({"actor_rollout_ref.rollout.multi_turn.enable"}))


def test_vault_data_without_multi_turn_stops_in_preflight(quick_assets):
    config = _ppo_config(**{"data.train_files": quick_assets.train_file, "data.val_files": quick_assets.val_file})
    with pytest.raises(ConfigError, match=r"data.train_files: .* 'hflow/vault', scored by its environment's verdict "
                                          r"in a multi-turn episode; set actor_rollout_ref.rollout.multi_turn.enable"):
        check_reward_sources(config)
    config.actor_rollout_ref.rollout.multi_turn.enable = True
    check_reward_sources(config)


def test_default_assets_meet_the_targets():
    """The default model (built into the cache if missing, about two minutes of one core): it looks at
    temperature 1 a fifth of the time, never greedily, and copies what it is shown."""
    import json
    from pathlib import Path

    base = json.loads(Path(vt.ensure_vault_assets().info_file).read_text())["base_model"]
    assert 0.1 <= base["look_prob_t1"] <= 0.3, base
    assert base["greedy_look_rate"] == 0.0 and base["greedy_opened"] <= 0.2, base
    assert base["copy_rate_after_look"] >= 0.95, base
