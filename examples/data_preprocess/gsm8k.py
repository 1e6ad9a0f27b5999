"""Convert GSM8K into hflow's parquet schema (``train.parquet`` and ``test.parquet``).

From local files (the GitHub release's ``train.jsonl``/``test.jsonl``, or the Hugging Face parquet
shards ``train-*.parquet``/``test-*.parquet``; a folder holding them works too)::

    python examples/data_preprocess/gsm8k.py --input ~/grade_school_math/data --local_dir ~/data/gsm8k

or, with network access and the ``datasets`` package, from the Hugging Face Hub::

    python examples/data_preprocess/gsm8k.py --from_hub --local_dir ~/data/gsm8k

Each row: ``data_source="openai/gsm8k"``, ``prompt`` (one user message asking for the answer after
``####``), ``ability="math"``, ``reward_model={"style": "rule", "ground_truth": "<number>"}`` and
``extra_info={"split", "index", "answer", "question"}``.

With ``--tools python`` (for multi-turn agent training, `examples/agent/`) the prompt opens with a system
message that offers the sandboxed ``python`` tool, and ``extra_info.tools_kwargs`` names it for every row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pandas as pd

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
TOOL_SYSTEM_PROMPT = (
    "You are a math expert. You may call the python tool to run Python code (print what you need; you see "
    "its output) as often as it helps. Output the final answer after \"####\"."
)


def extract_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K reference answer, without thousands commas."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without a '#### <number>' line: {answer!r}")
    return answer.split("####")[-1].strip().replace(",", "")


def make_row(example: dict[str, Any], split: str, index: int, tools: tuple[str, ...] = ()) -> dict[str, Any]:
    question, answer = example["question"], example["answer"]
    prompt = [{"role": "user", "content": question + " " + INSTRUCTION}]
    extra_info = {"split": split, "index": index, "answer": answer, "question": question}
    if tools:
        prompt.insert(0, {"role": "system", "content": TOOL_SYSTEM_PROMPT})
        extra_info["tools_kwargs"] = {name: {} for name in tools}
    return {
        "data_source": DATA_SOURCE,
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_answer(answer)},
        "extra_info": extra_info,
    }


def split_of(path: Path) -> str:
    for split in SPLITS:
        if path.name.lower().startswith(split):
            return split
    raise ValueError(f"cannot tell the split of {path}: name it train*.jsonl|parquet or test*.jsonl|parquet")


def read_file(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        with path.open() as lines:
            return [json.loads(line) for line in lines if line.strip()]
    if path.suffix == ".parquet":
        return pd.read_parquet(path).to_dict("records")
    raise ValueError(f"{path}: expected a .jsonl or .parquet file")


def read_local(inputs: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Examples per split from files and folders (a folder contributes its train*/test* files)."""
    files = []
    for entry in map(Path, inputs):
        entry = entry.expanduser()
        if entry.is_dir():
            found = sorted(
                path
                for path in entry.iterdir()
                if path.suffix in (".jsonl", ".parquet") and path.name.lower().startswith(SPLITS)
            )
            if not found:
                raise FileNotFoundError(f"--input {entry}: no train*/test* .jsonl or .parquet files in the folder")
            files += found
        elif entry.is_file():
            files.append(entry)
        else:
            raise FileNotFoundError(f"--input {entry}: no such file or folder")
    examples: dict[str, list[dict[str, Any]]] = {}
    for path in files:
        examples.setdefault(split_of(path), []).extend(read_file(path))
    return examples


def read_hub() -> dict[str, list[dict[str, Any]]]:
    import datasets  # only needed for --from_hub

    dataset = datasets.load_dataset("openai/gsm8k", "main")
    return {split: list(dataset[split]) for split in SPLITS}


def convert(examples: dict[str, list[dict[str, Any]]], local_dir: str | Path, tools: tuple[str, ...] = ()) -> list[Path]:
    """Write ``<split>.parquet`` for every split; returns the files written."""
    local_dir = Path(local_dir).expanduser()
    local_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for split, rows in examples.items():
        path = local_dir / f"{split}.parquet"
        pd.DataFrame([make_row(example, split, index, tools) for index, example in enumerate(rows)]).to_parquet(
            path, index=False
        )
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", help="local GSM8K .jsonl/.parquet files or folders holding them")
    source.add_argument("--from_hub", action="store_true", help="download openai/gsm8k (needs network, datasets)")
    parser.add_argument("--local_dir", default="~/data/gsm8k", help="where train.parquet and test.parquet go")
    parser.add_argument("--tools", nargs="*", default=[], choices=["python", "calculator"],
                        help="multi-turn: offer these tools in a system message and extra_info.tools_kwargs")
    args = parser.parse_args(argv)

    examples = read_hub() if args.from_hub else read_local(args.input)
    written = convert(examples, args.local_dir, tuple(args.tools))
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
