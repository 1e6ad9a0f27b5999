"""One reader for every data key (`data.train_files`, `data.val_files`, the supervised stages' files, PPO-ptx's):
rows as an Arrow table, whatever form the user keeps them in.

* parquet (``.parquet``),
* JSON lines (``.jsonl``, or ``.json`` holding one object per line, or one JSON array of objects),
* a folder written by ``datasets.Dataset.save_to_disk`` (it holds ``state.json`` and ``dataset_info.json`` beside
  its ``.arrow`` shards), or by ``datasets.DatasetDict.save_to_disk`` (``dataset_dict.json``, one such folder per
  split; the split read is ``data.train_split`` / ``data.val_split``, TRL's ``train`` / ``test`` by default).

Every format gives the same table for the same rows: lists stay lists, nested dicts (``reward_model``,
``extra_info``) stay structs, so the checks after reading (`RLHFDataset`'s, the supervised stages') are one
mechanism for all. Errors name the key and the file, a bad JSON line its line number, and a bad row is named
by `describe_row` (for JSON lines with its line, where it differs from the row). `iter_tables` reads a file in
pieces (parquet row groups, blocks of JSON lines, Arrow record batches) for `data.streaming`; nothing here loads
a file whole unless asked to.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hflow.utils.errors import ConfigError, DataError, DataFileNotFoundError

__all__ = ["FORMATS", "count_rows", "describe_row", "file_format", "iter_tables", "read_schema", "read_table",
           "resolve_files", "row_namer", "split_for"]

FORMATS = ("parquet files (.parquet), JSON lines (.jsonl, or .json with one object per line) and folders written by "
           "datasets' save_to_disk")
JSONL_SUFFIXES = (".jsonl", ".json")
# rows per piece of a JSON lines file read lazily (parquet's pieces are its row groups)
JSONL_BLOCK_ROWS = 1024


def file_format(path: str | os.PathLike, files_key: str) -> str:
    """"parquet", "jsonl", "arrow" (a save_to_disk folder of one split) or "arrow_dict" (of several), by the name or
    the folder's marker files; anything else is a `ConfigError` naming the key and the formats taken."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            return "arrow_dict"
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            return "arrow"
        raise DataError(f"{files_key}: {str(path)!r} is a folder but not one written by datasets' save_to_disk (it has "
                        f"no state.json/dataset_info.json, nor dataset_dict.json); give the files in it "
                        f"({files_key}=[a.parquet,b.jsonl]). {files_key} takes {FORMATS}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    raise ConfigError(f"{files_key}: {str(path)!r} has the extension {suffix or '(none)'!r}, which hflow does not "
                      f"read; {files_key} takes {FORMATS}. Convert it (e.g. pandas' DataFrame.to_parquet) or rename it")


def resolve_files(data_files: Any, files_key: str) -> list[str]:
    """The paths of a data key (one path or a list; ``~`` expanded), each present and of a format `file_format`
    takes; errors name `files_key`."""
    if data_files is None or (not isinstance(data_files, (str, os.PathLike)) and len(data_files) == 0):
        raise ConfigError(f"{files_key} is not set; give a data file or a list of them ({FORMATS})")
    paths = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    resolved = [os.path.expanduser(os.fspath(path)) for path in paths]
    for path in resolved:
        if not os.path.exists(path):
            raise DataFileNotFoundError(f"{files_key}: no such file {path!r}")
        file_format(path, files_key)
    return resolved


def _split_folder(path: str, files_key: str, split: str | None, split_key: str) -> Path:
    """The folder of `split` in a DatasetDict folder."""
    splits = json.loads((Path(path) / "dataset_dict.json").read_text()).get("splits", [])
    if split not in splits:
        raise ConfigError(f"{files_key}: {path} is a DatasetDict with splits {splits}, without {split!r} "
                          f"({split_key}); set {split_key} to one of them")
    return Path(path) / split


def _arrow_shards(folder: Path, files_key: str) -> list[Path]:
    state = json.loads((folder / "state.json").read_text())
    shards = [folder / entry["filename"] for entry in state.get("_data_files", [])]
    missing = [str(shard) for shard in shards if not shard.is_file()]
    if not shards or missing:
        raise DataError(f"{files_key}: {folder}: state.json lists the shards {[s.name for s in shards]}, "
                        f"{'of which ' + ', '.join(missing) + ' are missing' if missing else 'none'}; save the dataset "
                        "again with save_to_disk")
    return shards


def _arrow_batches(folder: Path, files_key: str) -> Iterator[pa.RecordBatch]:
    for shard in _arrow_shards(folder, files_key):
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(shard)))
        except (OSError, pa.ArrowException) as err:
            raise DataError(f"{files_key}: {shard} is not a readable Arrow shard ({type(err).__name__}: {err}); save "
                            "the dataset again with save_to_disk") from err
        yield from reader


def _unreadable_parquet(path: str, files_key: str, err: Exception) -> DataError:
    return DataError(f"{files_key}: {path} is not a readable parquet file ({type(err).__name__}: {err}); "
                     "write it with pandas' DataFrame.to_parquet or pyarrow.parquet.write_table")


def _json_records(path: str, files_key: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) of every non-blank line; a file that opens with ``[`` is one JSON array."""
    with open(path, encoding="utf-8") as handle:
        head = handle.read(1)
        while head.isspace():
            head = handle.read(1)
        handle.seek(0)
        if head == "[":
            try:
                records = json.load(handle)
            except json.JSONDecodeError as err:
                raise DataError(f"{files_key}: {path} line {err.lineno}: not valid JSON ({err.msg}, column "
                                f"{err.colno}); fix the file, or write one JSON object per line") from None
            for number, record in enumerate(records):
                if not isinstance(record, dict):
                    raise DataError(f"{files_key}: {path} row {number}: a {type(record).__name__}, not an object "
                                    "(a row needs its columns as keys)")
                yield number + 1, record
            return
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{files_key}: {path} line {number}: not valid JSON ({err.msg}, column {err.colno}); "
                                "every line must hold one JSON object: fix or delete the line") from None
            if not isinstance(record, dict):
                raise DataError(f"{files_key}: {path} line {number}: a JSON {type(record).__name__}, not an object; "
                                "every line must hold one row as an object of columns")
            yield number, record


def _records_table(records: list[dict], path: str, files_key: str, first_line: int) -> pa.Table:
    """Rows as a table with the types parquet would give them: pyarrow infers each column over all rows (the
    union of the keys; a row without a key is null there)."""
    if not records:
        return pa.table({})
    try:
        return pa.Table.from_struct_array(pa.array(records))
    except (pa.ArrowException, TypeError, ValueError) as err:
        raise DataError(f"{files_key}: {path} (from line {first_line}): a column holds values of different types "
                        f"({type(err).__name__}: {err}); give every row's column the same type") from None


def _jsonl_tables(path: str, files_key: str, block_rows: int) -> Iterator[pa.Table]:
    block: list[dict] = []
    first = 1
    for number, record in _json_records(path, files_key):
        if not block:
            first = number
        block.append(record)
        if len(block) == block_rows:
            yield _records_table(block, path, files_key, first)
            block = []
    if block:
        yield _records_table(block, path, files_key, first)


def _folder(path: str, files_key: str, split: str | None, split_key: str) -> Path:
    kind = file_format(path, files_key)
    return _split_folder(path, files_key, split, split_key) if kind == "arrow_dict" else Path(path)


def read_table(path: str | os.PathLike, files_key: str, columns: list[str] | None = None, split: str | None = "train",
               split_key: str = "data.train_split") -> pa.Table:
    """The whole file as one table (only `columns`, if given)."""
    path = os.fspath(path)
    kind = file_format(path, files_key)
    if kind == "parquet":
        try:
            return pq.read_table(path, columns=columns)
        except (OSError, pa.ArrowException) as err:
            raise _unreadable_parquet(path, files_key, err) from err
    if kind == "jsonl":  # with `columns`, only theirs are held (preflight reads one column of a large file)
        keep = (lambda record: {c: record.get(c) for c in columns if c in record}) if columns else (lambda r: r)
        table = _records_table([keep(record) for _, record in _json_records(path, files_key)], path, files_key, 1)
    else:
        batches = list(_arrow_batches(_folder(path, files_key, split, split_key), files_key))
        table = pa.Table.from_batches(batches) if batches else pa.table({})
    if columns is not None:
        absent = [column for column in columns if column not in table.column_names]
        if absent:
            raise DataError(f"{files_key}: {path} has no column {absent[0]!r}; its columns are {table.column_names}")
        table = table.select(columns)
    return table


def read_schema(path: str | os.PathLike, files_key: str, split: str | None = "train",
                split_key: str = "data.train_split") -> pa.Schema:
    """The columns and types of a file: parquet's footer, an Arrow shard's header, or (JSON lines, whose types only
    the rows tell) the first block's."""
    path = os.fspath(path)
    kind = file_format(path, files_key)
    if kind == "parquet":
        try:
            return pq.read_schema(path)
        except (OSError, pa.ArrowException) as err:
            raise _unreadable_parquet(path, files_key, err) from err
    return next(iter_tables(path, files_key, split=split, split_key=split_key), pa.table({})).schema


def iter_tables(path: str | os.PathLike, files_key: str, split: str | None = "train",
                split_key: str = "data.train_split", block_rows: int | None = None) -> Iterator[pa.Table]:
    """The file in consecutive pieces, read lazily: parquet row group by row group, JSON lines `block_rows` at a
    time, a save_to_disk folder record batch by record batch."""
    path = os.fspath(path)
    kind = file_format(path, files_key)
    if kind == "parquet":
        try:
            parquet = pq.ParquetFile(path)
            for group in range(parquet.num_row_groups):
                yield parquet.read_row_group(group)
        except (OSError, pa.ArrowException) as err:
            raise _unreadable_parquet(path, files_key, err) from err
    elif kind == "jsonl":
        yield from _jsonl_tables(path, files_key, block_rows or JSONL_BLOCK_ROWS)
    else:
        for batch in _arrow_batches(_folder(path, files_key, split, split_key), files_key):
            yield pa.Table.from_batches([batch])


def count_rows(path: str | os.PathLike, files_key: str, split: str | None = "train",
               split_key: str = "data.train_split") -> int:
    """Rows of a file without holding them: parquet's footer, the Arrow shards' batch lengths, JSON lines' lines."""
    path = os.fspath(path)
    if file_format(path, files_key) == "parquet":
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException) as err:
            raise _unreadable_parquet(path, files_key, err) from err
    if file_format(path, files_key) == "jsonl":
        return sum(1 for _ in _json_records(path, files_key))
    return sum(batch.num_rows for batch in _arrow_batches(_folder(path, files_key, split, split_key), files_key))


def row_namer(path: str) -> Callable[[int], str]:
    """A function naming row N of `path`: ``path row N`` (0-based, as the row of a table), for JSON lines with the
    line it is on (blank lines are skipped, so the two can differ; the lines are found once, here)."""
    if os.path.isfile(path) and Path(path).suffix.lower() in JSONL_SUFFIXES:
        lines = [number for number, _ in _json_records(path, "")]
        return lambda row: f"{path} row {row}" + (f" (line {lines[row]})" if 0 <= row < len(lines) else "")
    return lambda row: f"{path} row {row}"


def describe_row(path: str, row: int) -> str:
    """`row_namer`'s name of one row (for an error: a JSON lines file is read again)."""
    return row_namer(path)(row)


def split_for(data_config: Any, files_key: str) -> tuple[str | None, str]:
    """(the split to read from a DatasetDict folder, its key) for `files_key` of a `data` section: ``val_split`` for
    the validation files, ``train_split`` otherwise."""
    name = "val_split" if files_key.endswith("val_files") else "train_split"
    section = files_key.rsplit(".", 1)[0]
    value = data_config.get(name) if hasattr(data_config, "get") else getattr(data_config, name, None)
    return value, f"{section}.{name}"
