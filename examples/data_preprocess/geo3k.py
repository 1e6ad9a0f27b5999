"""Convert Geometry3K (geometry problems with a diagram) into hflow's parquet schema with images.

From the Hugging Face parquet shards of ``hiyouga/geometry3k`` (``train-*.parquet``, ``test-*.parquet``; a folder
holding them works too)::

    python examples/data_preprocess/geo3k.py --input ~/geometry3k/data --local_dir ~/data/geo3k

or, with network access and the ``datasets`` package, from the Hub::

    python examples/data_preprocess/geo3k.py --from_hub --local_dir ~/data/geo3k

Each row: ``data_source="hiyouga/geometry3k"`` (scored as MATH: the ``\\boxed{}`` answer), ``prompt`` (one user
message: the problem, whose ``<image>`` marks where the diagram goes, and the instruction), ``images`` (the
diagram as ``{"bytes", "path"}``: one per ``<image>``), ``ability="math"``,
``reward_model={"style": "rule", "ground_truth": answer}`` and ``extra_info={"split", "index", "question"}``.
A chart dataset with the same columns (``problem``, ``answer``, ``images``) converts the same way
(``--data_source``).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

import pandas as pd

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = "Think step by step, then put the final answer in \\boxed{}."
SPLITS = ("train", "validation", "test")


def image_struct(image: Any) -> dict[str, Any]:
    """An image as the ``{"bytes", "path"}`` struct hflow reads (PIL images are PNG-encoded)."""
    if isinstance(image, dict):
        return {"bytes": image.get("bytes"), "path": image.get("path")}
    if isinstance(image, (bytes, bytearray)):
        return {"bytes": bytes(image), "path": None}
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def make_row(example: dict[str, Any], split: str, index: int, data_source: str = DATA_SOURCE) -> dict[str, Any]:
    problem, images = example["problem"], [image_struct(image) for image in example["images"]]
    if "<image>" not in problem:  # the diagram first, where a problem does not place it
        problem = "<image>" * len(images) + problem
    if problem.count("<image>") != len(images):
        raise ValueError(f"{split} example {index}: {problem.count('<image>')} <image> placeholders, "
                         f"{len(images)} images")
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(example["answer"])},
        "extra_info": {"split": split, "index": index, "question": example["problem"]},
    }


def read_local(inputs: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Examples per split from parquet files and folders (a file's split is the start of its name)."""
    files: list[Path] = []
    for entry in map(lambda p: Path(p).expanduser(), inputs):
        if entry.is_dir():
            files += sorted(p for p in entry.iterdir() if p.suffix == ".parquet")
        elif entry.is_file():
            files.append(entry)
        else:
            raise FileNotFoundError(f"--input {entry}: no such file or folder")
    examples: dict[str, list[dict[str, Any]]] = {}
    for path in files:
        split = next((s for s in SPLITS if path.name.lower().startswith(s)), None)
        if split is None:
            raise ValueError(f"cannot tell the split of {path}: name it train*/validation*/test*.parquet")
        examples.setdefault(split, []).extend(pd.read_parquet(path).to_dict("records"))
    return examples


def read_hub() -> dict[str, list[dict[str, Any]]]:
    import datasets  # only needed for --from_hub

    dataset = datasets.load_dataset("hiyouga/geometry3k")
    return {split: list(dataset[split]) for split in dataset}


def convert(examples: dict[str, list[dict[str, Any]]], local_dir: str | Path,
            data_source: str = DATA_SOURCE) -> list[Path]:
    """Write ``<split>.parquet`` for every split; returns the files written."""
    local_dir = Path(local_dir).expanduser()
    local_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for split, rows in examples.items():
        path = local_dir / f"{split}.parquet"
        pd.DataFrame([make_row(example, split, i, data_source) for i, example in enumerate(rows)]).to_parquet(
            path, index=False)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", help="local parquet shards of hiyouga/geometry3k, or folders of them")
    source.add_argument("--from_hub", action="store_true", help="download hiyouga/geometry3k (network, datasets)")
    parser.add_argument("--local_dir", default="~/data/geo3k", help="where <split>.parquet go")
    parser.add_argument("--data_source", default=DATA_SOURCE, help="data_source of every row (selects the scorer)")
    args = parser.parse_args(argv)
    written = convert(read_hub() if args.from_hub else read_local(args.input), args.local_dir, args.data_source)
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
