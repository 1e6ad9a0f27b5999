"""Arithmetic word problems for GRPO on SmolLM2-135M-Instruct, as hflow parquet.

    python examples/smollm2_arith/make_data.py [--out DIR] [--train N] [--test N] [--seed S]

Writes ``DIR/train.parquet`` and ``DIR/test.parquet`` (default ``~/data/smollm2_arith``) in hflow's
schema, scored by the built-in ``hflow/arithmetic`` scorer (1.0 when the integer after "Answer:", or
else the last integer of the response, equals ``reward_model.ground_truth``):

    data_source   "hflow/arithmetic"
    prompt        [{"role": "user", "content": "<problem> <INSTRUCTION>"}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "<integer>"}
    extra_info    {"split", "index", "op", "a", "b", "question"}

A problem is an operation (add, sub, mul) on two small integers told as a story: a template, a name and
an object. Train and test are disjoint in their *arithmetic*, not only in their wording: each
``(op, a, b)`` triple belongs to one split only, so the held-out accuracy measures arithmetic the
policy did not practise. The same arguments always give identical files.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pandas as pd

DATA_SOURCE = "hflow/arithmetic"
INSTRUCTION = "Give the final answer as 'Answer: <number>'."
DEFAULT_OUT = Path.home() / "data" / "smollm2_arith"

# (name, subject pronoun, possessive pronoun)
NAMES = [
    ("Tom", "he", "his"), ("Anna", "she", "her"), ("Ben", "he", "his"), ("Lucy", "she", "her"),
    ("Sam", "he", "his"), ("Mia", "she", "her"), ("Leo", "he", "his"), ("Emma", "she", "her"),
    ("Jack", "he", "his"), ("Sara", "she", "her"), ("Omar", "he", "his"), ("Nina", "she", "her"),
]
OBJECTS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "cards", "balloons", "shells", "coins"]

# Templates per operation; fields: {name} {he} {He} {his} {other} {obj} {a} {b}. The answer is
# a + b, a - b or a * b.
TEMPLATES = {
    "add": [
        "{name} has {a} {obj} and buys {b} more. How many {obj} does {he} have now?",
        "There are {a} {obj} in a box. {name} puts {b} more {obj} into the box. How many {obj} are in the box now?",
        "{name} collected {a} {obj} on Monday and {b} {obj} on Tuesday. How many {obj} did {he} collect in total?",
        "{name} has {a} {obj}. {other} gives {name} {b} more {obj}. How many {obj} does {name} have now?",
    ],
    "sub": [
        "{name} has {a} {obj} and gives {b} of them to {other}. How many {obj} does {name} have left?",
        "There are {a} {obj} in a basket. {name} takes {b} {obj} out of the basket. How many {obj} are left in the basket?",
        "{name} had {a} {obj}. {He} lost {b} of them. How many {obj} does {he} have now?",
        "{name} wants {a} {obj}. {He} already has {b}. How many more {obj} does {he} need?",
    ],
    "mul": [
        "{name} buys {a} bags of {obj}. Each bag holds {b} {obj}. How many {obj} does {he} buy in all?",
        "There are {a} boxes with {b} {obj} in each box. How many {obj} are there altogether?",
        "{name} puts {b} {obj} on each of {a} tables. How many {obj} does {he} put out in total?",
        "{name} has {a} friends and gives each friend {b} {obj}. How many {obj} does {he} give away?",
    ],
}

# Operand ranges (inclusive) per operation. Chosen so that SmolLM2-135M-Instruct solves a minority of
# problems greedily but a clearly larger share among 4 samples (see README.md for the measurements).
RANGES = {
    "add": ((2, 40), (2, 40)),
    "sub": ((5, 50), (1, 40)),  # b < a
    "mul": ((2, 12), (2, 12)),
}
OPS = ("add", "sub", "mul")


def answer(op: str, a: int, b: int) -> int:
    return {"add": a + b, "sub": a - b, "mul": a * b}[op]


def all_triples() -> list[tuple[str, int, int]]:
    """Every admissible (op, a, b), in a fixed order."""
    triples = []
    for op in OPS:
        (a_lo, a_hi), (b_lo, b_hi) = RANGES[op]
        for a in range(a_lo, a_hi + 1):
            for b in range(b_lo, b_hi + 1):
                if op == "sub" and b >= a:
                    continue
                triples.append((op, a, b))
    return triples


def render(rng: random.Random, op: str, a: int, b: int) -> str:
    template = rng.choice(TEMPLATES[op])
    name, he, his = rng.choice(NAMES)
    other = rng.choice([n for n, _, _ in NAMES if n != name])
    obj = rng.choice(OBJECTS)
    return template.format(name=name, he=he, He=he.capitalize(), his=his, other=other, obj=obj, a=a, b=b)


def make_rows(triples: list[tuple[str, int, int]], split: str, rng: random.Random, instruction: str) -> list[dict]:
    rows = []
    for index, (op, a, b) in enumerate(triples):
        question = render(rng, op, a, b)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer(op, a, b))},
                "extra_info": {"split": split, "index": index, "op": op, "a": a, "b": b, "question": question},
            }
        )
    return rows


def split_counts(total: int, capacity: dict[str, int]) -> dict[str, int]:
    """``total`` spread as evenly as possible over the operations, none above its capacity."""
    counts = {op: 0 for op in OPS}
    left = total
    while left > 0:
        open_ops = [op for op in OPS if counts[op] < capacity[op]]
        if not open_ops:
            raise ValueError(f"{total} problems requested, only {sum(capacity.values())} exist")
        share, extra = divmod(left, len(open_ops))
        for i, op in enumerate(open_ops):
            take = min(share + (1 if i < extra else 0), capacity[op] - counts[op])
            counts[op] += take
            left -= take
    return counts


def build(n_train: int, n_test: int, seed: int = 0, instruction: str = INSTRUCTION) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Train and test frames. Each (op, a, b) lands in one split only; the test split is balanced over
    the operations, the train split as balanced as the number of distinct problems allows."""
    rng = random.Random(seed)
    pools = {op: [t for t in all_triples() if t[0] == op] for op in OPS}
    for op in OPS:
        rng.shuffle(pools[op])
    k_test = split_counts(n_test, {op: len(pool) for op, pool in pools.items()})
    k_train = split_counts(n_train, {op: len(pools[op]) - k_test[op] for op in OPS})
    test = [t for op in OPS for t in pools[op][: k_test[op]]]
    train = [t for op in OPS for t in pools[op][k_test[op] : k_test[op] + k_train[op]]]
    rng.shuffle(train)
    rng.shuffle(test)
    train_df = pd.DataFrame(make_rows(train, "train", random.Random(seed * 1000 + 1), instruction))
    test_df = pd.DataFrame(make_rows(test, "test", random.Random(seed * 1000 + 2), instruction))
    return train_df, test_df


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--train", type=int, default=540, help="number of training problems")
    parser.add_argument("--test", type=int, default=200, help="number of held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    train_df, test_df = build(args.train, args.test, args.seed)
    out = args.out.expanduser()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for split, frame in (("train", train_df), ("test", test_df)):
        path = out / f"{split}.parquet"
        frame.to_parquet(path, index=False)
        written.append(path)
        print(f"wrote {path}: {len(frame)} problems")
    return written


if __name__ == "__main__":
    main()
