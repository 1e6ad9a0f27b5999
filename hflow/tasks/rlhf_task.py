"""The built-in RLHF task: data for the three stages (SFT, reward model, PPO) on the built-in model.

The prompts are the built-in arithmetic questions (`hflow.tasks.builtin_task`, same train/val split).
Demonstrators answer every question correctly but in one of four styles:

    plain     "12"                  45 %
    house     "The answer is 12."   20 %   <- what the hidden rule prefers
    hedge     "I think it is 12."   20 %
    equation  "7 + 5 = 12"          15 %

The hidden rule (`hflow.utils.reward_score.answer_style`, data source ``hflow/arithmetic-style``) scores
the house style 1 (0.5 with a wrong number), any other form 0. After SFT the greedy answer is the most
common style (plain): the true score starts near 0 while a sampled answer is in the house style a fifth
of the time. Preference pairs put a house-style answer against another style of the same question,
labelled by the rule; the reward model learns the rule from pairs on the training questions only, so
the held-out questions (the PPO validation set) were never seen by it. Like lm-human-preferences'
stylistic tasks, the preference is about form, which a tiny model can learn; reward hacking would show
as the reward model's score rising while the rule's score falls.

Files (`ensure_rlhf_task_data()`, written once into ``$HFLOW_CACHE/rlhf-task-v<VERSION>``; pure Python,
seconds):

    sft_train.parquet, sft_val.parquet     messages: [user question, assistant demonstration]
    rm_train.parquet, rm_val.parquet       prompt (chat), chosen, rejected (response texts)
    ppo_train.parquet, ppo_val.parquet     the hflow RL data contract, data_source hflow/arithmetic-style
"""

from __future__ import annotations

import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hflow.tasks.builtin_task import Problem, builtin_problems, default_cache_root, split_problems

__all__ = ["DATA_SOURCE", "STYLES", "RLHFTaskData", "ensure_rlhf_task_data", "render"]

VERSION = "1"
DATA_SOURCE = "hflow/arithmetic-style"
HOUSE_STYLE = "house"
# style -> (share of demonstrations, template)
STYLES: dict[str, tuple[float, str]] = {
    "plain": (0.45, "{answer}"),
    "house": (0.20, "The answer is {answer}."),
    "hedge": (0.20, "I think it is {answer}."),
    "equation": (0.15, "{a} {op} {b} = {answer}"),
}
DEMOS_PER_TRAIN_QUESTION = 4
DEMOS_PER_VAL_QUESTION = 2
_SEED = 0
_MARKER = "COMPLETE"


@dataclass(frozen=True)
class RLHFTaskData:
    root: str
    sft_train: str
    sft_val: str
    rm_train: str
    rm_val: str
    ppo_train: str
    ppo_val: str


def render(problem: Problem, style: str) -> str:
    return STYLES[style][1].format(answer=problem.answer, a=problem.a, op=problem.op, b=problem.b)


def _chat(problem: Problem) -> list[dict[str, str]]:
    return [{"role": "user", "content": problem.question}]


def _demonstrations(problems: list[Problem], per_question: int, rng: random.Random) -> list[dict]:
    names = list(STYLES)
    weights = [STYLES[name][0] for name in names]
    return [{"messages": _chat(p) + [{"role": "assistant", "content": render(p, style)}], "style": style}
            for p in problems for style in rng.choices(names, weights, k=per_question)]


def _preference_pairs(problems: list[Problem]) -> list[dict]:
    """For every question, the house-style answer against each other style (the rule orders them)."""
    return [{"prompt": _chat(p), "chosen": render(p, HOUSE_STYLE), "rejected": render(p, style),
             "rejected_style": style}
            for p in problems for style in STYLES if style != HOUSE_STYLE]


def _rl_rows(problems: list[Problem], split: str) -> list[dict]:
    return [{"data_source": DATA_SOURCE, "prompt": _chat(p), "ability": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
             "extra_info": {"split": split, "index": i, "answer": p.answer}}
            for i, p in enumerate(problems)]


def _write(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def _files(root: Path) -> RLHFTaskData:
    return RLHFTaskData(str(root), *(str(root / f"{name}.parquet") for name in
                                     ("sft_train", "sft_val", "rm_train", "rm_val", "ppo_train", "ppo_val")))


def ensure_rlhf_task_data(cache_dir: str | Path | None = None) -> RLHFTaskData:
    """The task's parquet files, written on first use (into a temporary folder renamed into place)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    final = root / f"rlhf-task-v{VERSION}"
    if (final / _MARKER).exists():
        return _files(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        train, val = split_problems(builtin_problems(), num_val_per_op=20)
        rng = random.Random(_SEED)
        _write(_demonstrations(train, DEMOS_PER_TRAIN_QUESTION, rng), tmp / "sft_train.parquet")
        _write(_demonstrations(val, DEMOS_PER_VAL_QUESTION, rng), tmp / "sft_val.parquet")
        _write(_preference_pairs(train), tmp / "rm_train.parquet")
        _write(_preference_pairs(val), tmp / "rm_val.parquet")
        _write(_rl_rows(train, "train"), tmp / "ppo_train.parquet")
        _write(_rl_rows(val, "val"), tmp / "ppo_val.parquet")
        (tmp / _MARKER).write_text(VERSION)
        tmp.chmod(0o755)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first: its files are the same bytes
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _files(final)


if __name__ == "__main__":
    import json
    from dataclasses import asdict

    print(json.dumps(asdict(ensure_rlhf_task_data()), indent=2))
