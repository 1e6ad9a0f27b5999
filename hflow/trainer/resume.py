"""Resume says what it resumes: a checkpoint records the model it was trained from, and a restart into an
experiment folder whose checkpoint came from another model stops before anything loads.

Without this, a rerun into an existing experiment with another model died in a torch traceback ("size
mismatch 512 vs 514") with no word of `trainer.experiment_name` or `trainer.resume_mode`, and a model of the
same shapes at a new path was silently replaced by the old checkpoint's weights.

Each step folder gets `model_origin.json` (the model path each checkpointed role was built from); the
shapes are read from the role's `huggingface/config.json`, which every checkpoint already holds
(`save_model_info`), so checkpoints written before this record are checked by their shapes too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hflow.utils.errors import ConfigError

__all__ = ["ORIGIN_FILE", "SHAPE_KEYS", "check_resume_origin", "write_model_origin"]

ORIGIN_FILE = "model_origin.json"
# What a checkpoint's tensors depend on: a model that differs in any of these cannot load its shards.
SHAPE_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def write_model_origin(step_dir: str | Path, model_paths: dict[str, str]) -> None:
    """Record {role: model path} in `step_dir` (before the step is committed)."""
    origin = {role: str(Path(str(path)).expanduser().resolve()) for role, path in model_paths.items() if path}
    (Path(step_dir) / ORIGIN_FILE).write_text(json.dumps(origin, indent=2) + "\n")


def check_resume_origin(step_dir: Path | None, role: str, model_key: str, model_path: str | None) -> str | None:
    """The checkpoint in `step_dir` (None: nothing to resume) against the model `model_key`=`model_path` that
    the run names for `role`: a ConfigError naming both and the keys that choose when their shapes differ, or
    when the step holds no checkpoint of `role`; else the line to print about what is resumed (None when
    there is nothing to say)."""
    if step_dir is None or model_path is None:
        return None
    if not (Path(step_dir) / role).is_dir():  # another kind of run's folder: GRPO's has no critic, PPO's no model
        held = sorted(p.name for p in Path(step_dir).iterdir() if p.is_dir()) if Path(step_dir).is_dir() else []
        raise ConfigError(
            f"trainer.resume_mode would resume {step_dir}, which holds no {role!r} checkpoint (it holds "
            f"{', '.join(map(repr, held)) or 'nothing'}): another kind of run wrote it, and this one needs its "
            f"{role}. Give the run its own folder (a new trainer.experiment_name or trainer.default_local_dir), or "
            "set trainer.resume_mode=disable to start from the models the run names")
    saved_config = _read_json(Path(step_dir) / role / "huggingface" / "config.json")
    new_config = _read_json(Path(str(model_path)).expanduser() / "config.json")
    saved_path = (_read_json(Path(step_dir) / ORIGIN_FILE) or {}).get(role)
    if saved_config is None or new_config is None:
        return None  # nothing to compare with: the load will tell
    new_path = str(Path(str(model_path)).expanduser().resolve())
    trained_from = f" (trained from {saved_path})" if saved_path else ""
    differ = {key: (saved_config.get(key), new_config.get(key)) for key in SHAPE_KEYS
              if saved_config.get(key) != new_config.get(key)}
    if differ:
        shown = ", ".join(f"{key} {old} vs {new}" for key, (old, new) in differ.items())
        raise ConfigError(
            f"trainer.resume_mode would resume {step_dir}{trained_from}, but {model_key}={model_path} is another "
            f"model ({shown}: checkpoint vs {model_key}). To train this model from its start, give the run a new "
            f"trainer.experiment_name (a fresh checkpoint folder) or set trainer.resume_mode=disable; to resume that "
            f"checkpoint, set {model_key} back to {saved_path or 'the model it was trained from'}")
    if saved_path and saved_path != new_path:
        return (f"resuming {step_dir}{trained_from}: {model_key}={model_path} has the same shapes, so the "
                "checkpoint's weights are trained on, not that model's")
    return f"resuming {step_dir}{trained_from}"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
