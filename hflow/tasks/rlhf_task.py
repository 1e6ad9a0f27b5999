"""The built-in RLHF task: data for the three stages (SFT, reward model, PPO) on the built-in model.

The prompts are the built-in arithmetic questions (`hflow.tasks.builtin_task`, same train/val split).
Demonstrators answer every question correctly but in one of four styles:

    plain     "12"                  45 %
    house     "The answer is 12."   20 %   <- the style the hidden preference likes best
    hedge     "I think it is 12."   20 %
    equation  "7 + 5 = 12"          15 %

The hidden preference (`hflow.reward.score.answer_style`, data source ``hflow/arithmetic-style``)
needs the number to be right: 1 for the right number in the house style, 0.5 for the right number in
another style, 0 for a wrong number. The preference pairs, labelled by it, are of two kinds (column
``kind``):

    number   same style, the right number against a wrong one (one too high, the base model's habit,
             and one other wrong number near the answer), in every style
    style    both right, the house style against each other style

so that style alone ranks only the style pairs: the number pairs, 8 of every 11, need the arithmetic.
The reward model learns from pairs on the training questions only; the held-out questions' pairs
(``rm_val``) and prompts (``ppo_val``) are what the pipeline measures on. After SFT the greedy answer is
mostly in the plain style, and on held-out questions often has the wrong number (the base model's habit
survives SFT there), so PPO has both to fix. A reward model that learned only the style shows as chance
accuracy on the number pairs, and PPO against it as the house-style share and the reward model's score
rising while the exact-correct rate does not (reward hacking, which the pipeline's summary flags).
(Pairs of a right answer in another style against a wrong one in the house style were tried and dropped:
the built-in reward model, which does not learn to tell right numbers from wrong, ranked them 0.27 and
learned even the style more slowly; examples/rlhf_pipeline/README.md.)

Files (`ensure_rlhf_task_data()`, written once into ``$HFLOW_CACHE/rlhf-task-v<VERSION>``; pure Python,
seconds):

    sft_train.parquet, sft_val.parquet     messages: [user question, assistant demonstration]
    rm_train.parquet, rm_val.parquet       prompt (chat), chosen, rejected (response texts), kind
    ppo_train.parquet, ppo_val.parquet     the hflow RL data contract, data_source hflow/arithmetic-style
"""

from __future__ import annotations

import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hflow.tasks.assets import task_row, write_parquet
from hflow.tasks.builtin_task import Problem, builtin_problems, split_problems
from hflow.utils.cache import default_cache_root
from hflow.reward.score import answer_style

__all__ = ["DATA_SOURCE", "PAIR_KINDS", "STYLES", "RLHFTaskData", "ensure_rlhf_task_data", "render",
           "write_shuffled_labels"]

VERSION = "2"
DATA_SOURCE = "hflow/arithmetic-style"
HOUSE_STYLE = answer_style.HOUSE_STYLE
PAIR_KINDS = ("number", "style")
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


def render(problem: Problem, style: str, answer: int | None = None) -> str:
    """`problem` answered in `style`, with its right answer or the given (wrong) one."""
    answer = problem.answer if answer is None else answer
    return STYLES[style][1].format(answer=answer, a=problem.a, op=problem.op, b=problem.b)


def _chat(problem: Problem) -> list[dict[str, str]]:
    return [{"role": "user", "content": problem.question}]


def _demonstrations(problems: list[Problem], per_question: int, rng: random.Random) -> list[dict]:
    names = list(STYLES)
    weights = [STYLES[name][0] for name in names]
    return [{"messages": _chat(p) + [{"role": "assistant", "content": render(p, style)}], "style": style}
            for p in problems for style in rng.choices(names, weights, k=per_question)]


def _wrong_answers(problem: Problem, rng: random.Random) -> list[int]:
    """One too high (the base model's habit) and one other non-negative wrong number near the answer."""
    others = [n for n in range(problem.answer - 3, problem.answer + 4)
              if n >= 0 and n not in (problem.answer, problem.answer + 1)]
    return [problem.answer + 1, rng.choice(others)]


def _preference_pairs(problems: list[Problem], rng: random.Random) -> list[dict]:
    """Per question: number pairs in every style, then the style pairs; each labelled by the hidden
    preference (checked: the chosen answer scores higher)."""
    rows = []

    def pair(p: Problem, kind: str, chosen: tuple[str, int], rejected: tuple[str, int]) -> None:
        row = {"prompt": _chat(p), "chosen": render(p, *chosen), "rejected": render(p, *rejected), "kind": kind}
        if not answer_style.compute_score(row["chosen"], p.answer) > answer_style.compute_score(row["rejected"], p.answer):
            raise RuntimeError(f"the hidden preference does not prefer {row['chosen']!r} to {row['rejected']!r} "
                               f"for {p.question!r}: {kind} pairs would be mislabelled")
        rows.append(row)

    for p in problems:
        for style in STYLES:
            for wrong in _wrong_answers(p, rng):
                pair(p, "number", (style, p.answer), (style, wrong))
        for style in STYLES:
            if style != HOUSE_STYLE:
                pair(p, "style", (HOUSE_STYLE, p.answer), (style, p.answer))
    return rows


def _rl_rows(problems: list[Problem], split: str) -> list[dict]:
    return [task_row(DATA_SOURCE, "arithmetic", p.question, p.answer, {"split": split, "index": i, "answer": p.answer})
            for i, p in enumerate(problems)]


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
        write_parquet(_demonstrations(train, DEMOS_PER_TRAIN_QUESTION, rng), tmp / "sft_train.parquet")
        write_parquet(_demonstrations(val, DEMOS_PER_VAL_QUESTION, rng), tmp / "sft_val.parquet")
        write_parquet(_preference_pairs(train, rng), tmp / "rm_train.parquet")
        write_parquet(_preference_pairs(val, rng), tmp / "rm_val.parquet")
        write_parquet(_rl_rows(train, "train"), tmp / "ppo_train.parquet")
        write_parquet(_rl_rows(val, "val"), tmp / "ppo_val.parquet")
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


def write_shuffled_labels(pairs: str | Path, out: str | Path, seed: int = 0) -> str:
    """The control of a preference-learning claim: `pairs` with chosen and rejected swapped in a random
    half of the rows (exactly half, seeded), so the labels carry no preference; written to `out`."""
    import pyarrow.parquet as pq

    rows = pq.read_table(pairs).to_pylist()
    rng = random.Random(seed)
    for i in rng.sample(range(len(rows)), len(rows) // 2):
        rows[i]["chosen"], rows[i]["rejected"] = rows[i]["rejected"], rows[i]["chosen"]
    write_parquet(rows, Path(out))
    return str(out)


if __name__ == "__main__":
    import json
    from dataclasses import asdict

    print(json.dumps(asdict(ensure_rlhf_task_data()), indent=2))
