"""Resume says what it resumes (issue 39): a restart into a checkpoint of another model stops naming both
models and the keys that choose; the same shapes at another path resume with a line that says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hflow.trainer.resume import ORIGIN_FILE, check_resume_origin, write_model_origin
from hflow.utils.errors import ConfigError

QWEN = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 512, "hidden_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
        "tie_word_embeddings": False}


def model_dir(root: Path, name: str, **changes) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN, **changes}))
    return folder


def checkpoint(root: Path, trained_from: Path | None, **changes) -> Path:
    step = root / "exp" / "global_step_1"
    (step / "actor" / "huggingface").mkdir(parents=True)
    (step / "actor" / "huggingface" / "config.json").write_text(json.dumps({**QWEN, **changes}))
    if trained_from is not None:
        write_model_origin(step, {"actor": str(trained_from), "critic": None})
    return step


def test_another_model_stops_naming_both_and_the_keys_that_choose(tmp_path):
    old = model_dir(tmp_path, "old")
    new = model_dir(tmp_path, "new", vocab_size=514)
    step = checkpoint(tmp_path, old)
    with pytest.raises(ConfigError) as error:
        check_resume_origin(step, "actor", "actor_rollout_ref.model.path", str(new))
    message = str(error.value)
    for words in (str(step), f"trained from {old.resolve()}", f"actor_rollout_ref.model.path={new}",
                  "vocab_size 512 vs 514", "trainer.experiment_name", "trainer.resume_mode=disable",
                  f"set actor_rollout_ref.model.path back to {old.resolve()}"):
        assert words in message, (words, message)


def test_a_checkpoint_without_the_record_is_still_checked_by_its_shapes(tmp_path):
    step = checkpoint(tmp_path, None, hidden_size=256)
    with pytest.raises(ConfigError, match="hidden_size 256 vs 128"):
        check_resume_origin(step, "actor", "actor_rollout_ref.model.path", str(model_dir(tmp_path, "m")))


def test_same_shapes_at_another_path_resume_with_a_line_that_says_so(tmp_path):
    old = model_dir(tmp_path, "old")
    moved = model_dir(tmp_path, "moved")
    step = checkpoint(tmp_path, old)
    assert json.loads((step / ORIGIN_FILE).read_text()) == {"actor": str(old.resolve())}
    line = check_resume_origin(step, "actor", "actor_rollout_ref.model.path", str(moved))
    assert f"trained from {old.resolve()}" in line and "same shapes" in line and "checkpoint's weights" in line
    assert check_resume_origin(step, "actor", "actor_rollout_ref.model.path", str(old)) == (
        f"resuming {step} (trained from {old.resolve()})")


def test_nothing_to_resume_says_nothing(tmp_path):
    assert check_resume_origin(None, "actor", "actor_rollout_ref.model.path", str(model_dir(tmp_path, "m"))) is None


def test_a_rerun_into_an_experiment_of_another_model_stops_before_anything_starts(tmp_path, monkeypatch, capsys):
    """The issue's row: the built-in run pointed at an experiment folder whose checkpoint came from a model with
    another vocabulary ends in one `hflow: error:` line naming both, before Ray or any model starts."""
    import importlib
    import sys

    from hflow.tasks.builtin_task import ensure_builtin_assets
    from hflow.trainer.checkpoints import LATEST_MARKER

    builtin = Path(ensure_builtin_assets().model_path)
    shape = json.loads((builtin / "config.json").read_text())
    experiment = tmp_path / "exp"
    step = experiment / "global_step_1"
    (step / "actor" / "huggingface").mkdir(parents=True)
    (step / "actor" / "huggingface" / "config.json").write_text(json.dumps({**shape, "vocab_size": shape["vocab_size"] + 2}))
    (step / "data").mkdir()
    (step / "data" / "state.pt").write_bytes(b"")
    write_model_origin(step, {"actor": str(tmp_path / "older-model")})
    (experiment / LATEST_MARKER).write_text("1")

    main_ppo = importlib.import_module("hflow.trainer.main_ppo")
    monkeypatch.setattr(main_ppo, "build_trainer", lambda *a, **k: pytest.fail("the run got past preflight"))
    monkeypatch.setattr(main_ppo, "install_library_filter", lambda: None)
    monkeypatch.setattr(main_ppo, "_stop_ray", lambda: None)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["main_ppo", "algorithm.adv_estimator=grpo", f"trainer.default_local_dir={experiment}",
                                      "hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.output_subdir=null",
                                      f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as exit_:
        main_ppo.main()
    captured = capsys.readouterr()
    last = (captured.out + captured.err).strip().splitlines()[-1]
    assert exit_.value.code == 1 and "Traceback" not in captured.err
    assert last.startswith("hflow: error: trainer.resume_mode would resume"), last
    for words in (str(step), f"vocab_size {shape['vocab_size'] + 2} vs {shape['vocab_size']}", "trainer.experiment_name",
                  "trainer.resume_mode=disable"):
        assert words in last, (words, last)
    assert "Started a local Ray instance" not in captured.out + captured.err  # it stopped in preflight
