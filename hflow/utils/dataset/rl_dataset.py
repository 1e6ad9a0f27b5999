"""RLHFDataset: chat prompts from data files (parquet, JSON lines or a save_to_disk folder: `sources`), templated,
tokenized and left-padded for generation.

Each row holds ``prompt`` (chat messages, a list of ``{"role", "content"}``), ``data_source``,
``reward_model`` (a struct with ``ground_truth``), and optionally ``ability`` and ``extra_info``
(see ``examples/data_preprocess/gsm8k.py``). Prompts are left-padded because generation appends
the response on the right; rows are read from the Arrow table on demand, so a large file costs
little memory (`data.streaming` reads them lazily instead: `hflow.utils.dataset.streaming`).
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from hflow.utils.dataset.sources import describe_row, read_table, resolve_files, split_for
from hflow.utils.errors import ConfigError, DataError
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.utils.vision import MM_INPUTS, decode_image, split_image_placeholders

__all__ = ["RLHFDataset", "apply_chat_template", "check_prompt_table", "collate_fn"]

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")


class RLHFDataset(Dataset):
    """Prompts for RL, one item per row of the data files.

    Args:
        data_files: one path or a list (``~`` is expanded), in any mix of the formats `sources.FORMATS` names; a
            DatasetDict folder is read at its ``data.train_split`` (``data.val_split`` for ``data.val_files``).
        tokenizer: a Hugging Face tokenizer with a chat template (or set ``data.chat_template``).
        config: the ``data`` config section; reads ``prompt_key``, ``reward_fn_key``,
            ``max_prompt_length``, ``truncation``, ``filter_overlong_prompts``, ``return_raw_chat``,
            ``chat_template`` (every key present: build one by hand from
            ``hflow.trainer.config.default_config().data``).
        files_key: the config key the files came from, for error messages.
        tools: OpenAI function schemas of a multi-turn rollout's tools: the chat template gets them (as
            ``tools=``, for templates that describe tools in the prompt) and items carry ``tools_kwargs``
            (``extra_info.tools_kwargs``, {} when absent) and ``agent_kwargs`` (the row's data_source,
            agent_name, extra_info and prompt messages, for environments and simulated users).
        processor: the model's processor for images (`hflow.utils.vision.load_processor`), None for a
            text-only model. Rows of the ``data.image_key`` column's images (verl's convention: raw bytes, a
            path or a ``{"bytes", "path"}`` struct each, one ``<image>`` placeholder per image in the prompt
            text) are encoded with it: the prompt's ids hold the image tokens (and count them against
            ``max_prompt_length``), and the item carries ``multi_modal_inputs`` (``pixel_values``,
            ``image_grid_thw``) for the forward passes and ``multi_modal_data`` (``{"image": [PIL images]}``)
            for the sampler. Images are read and checked at load; a missing or unreadable image, placeholders
            that do not match the images, images for a model without an image processor, and an image prompt
            that would need truncating stop the load, naming the row.

    An item has ``input_ids``, ``attention_mask``, ``position_ids`` (tensors of length
    ``max_prompt_length``, left-padded), ``raw_prompt_ids`` (the unpadded ids, for vLLM),
    ``raw_prompt`` (the messages; only with ``return_raw_chat``), ``index`` (``extra_info.index``, else
    the row number) and every other column of the row (``data_source``, ``reward_model``, ...).
    With ``filter_overlong_prompts``, longer prompts are dropped at load and counted in `num_filtered`;
    without it and with ``truncation=error``, a longer prompt stops the load, naming its file and row.
    Errors name the file, and for one prompt its row: `ConfigError` for a setting, `DataError` for the data
    (both ValueErrors).
    """

    def __init__(
        self,
        data_files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        config: DictConfig,
        files_key: str = "data.train_files",
        tools: Sequence[dict] | None = None,
        processor: Any = None,
    ) -> None:
        self._configure(tokenizer, config, files_key, tools, processor)
        self.files = resolve_files(data_files, files_key)
        tables = [self._read(path, files_key) for path in self.files]
        # The first row of each file in the concatenated table, and after filtering the rows kept: a
        # sample's file and row, for the messages.
        self._file_starts = np.cumsum([0] + [table.num_rows for table in tables[:-1]]).tolist()
        self._kept: list[int] | None = None
        self._table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        self.has_images = self._check_images()
        if self._table.num_rows:
            self._render(self._table.column(self.prompt_key)[0].as_py(), 0)  # a template that fails, fails now
        self.num_filtered = 0
        if config.filter_overlong_prompts:
            self._drop_overlong()
        elif self.truncation == "error" or self.has_images:  # image prompts are never truncated
            self._check_lengths()

    def _configure(self, tokenizer: Any, config: DictConfig, files_key: str, tools: Sequence[dict] | None,
                   processor: Any) -> None:
        """The settings of items, checked (shared with the streamed prompts of `streaming`)."""
        self.tokenizer = tokenizer
        self.processor = processor
        self.image_key = config.image_key
        self.tools = list(tools) if tools else None
        self.prompt_key = config.prompt_key
        self.reward_fn_key = config.reward_fn_key
        self.max_prompt_length = int(config.max_prompt_length)
        self.truncation = config.truncation
        self.return_raw_chat = bool(config.return_raw_chat)
        self.chat_template = config.chat_template
        self.files_key = files_key
        self.split, self.split_key = split_for(config, files_key)  # of a DatasetDict folder
        if self.truncation not in TRUNCATION_MODES:
            raise ConfigError(f"data.truncation={self.truncation!r}; choose one of {list(TRUNCATION_MODES)}")
        if self.max_prompt_length < 1:
            raise ConfigError(f"data.max_prompt_length={self.max_prompt_length}; it must be at least 1")
        tokenizer_name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        if self.chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"the tokenizer ({tokenizer_name}) has no chat template; set data.chat_template to a Jinja chat "
                "template, or use a model folder whose tokenizer has one"
            )
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_token_id is None:
            raise ConfigError(f"the tokenizer ({tokenizer_name}) has neither a pad token nor an EOS token to pad "
                              "prompts with; give its tokenizer_config.json an eos_token")
        # with data.mixture, items name their file (`data_file`: its index in the list): rows drawn per file per step
        self.tag_files = files_key == "data.train_files" and config.get("mixture") is not None

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.encode_row(self._table.slice(index, 1).to_pylist()[0], index)

    def encode_row(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        """The item of one row (a dict of its columns), sample `index` (for `_where`, and the default ``index``)."""
        messages = row.pop(self.prompt_key)
        if self.has_images:
            ids, row[MM_INPUTS], row["multi_modal_data"] = self._encode_with_images(
                messages, row.pop(self.image_key), index)
        else:
            ids = self._encode(messages, index)
        ids = self._truncate(ids, index)

        padding = self.max_prompt_length - len(ids)
        input_ids = torch.tensor([self.pad_token_id] * padding + ids, dtype=torch.long)
        attention_mask = torch.tensor([0] * padding + [1] * len(ids), dtype=torch.long)
        row["input_ids"] = input_ids
        row["attention_mask"] = attention_mask
        row["position_ids"] = compute_position_id_with_mask(attention_mask)
        row["raw_prompt_ids"] = ids
        if self.return_raw_chat:
            row["raw_prompt"] = messages
        extra_info = row.get("extra_info")
        given_index = extra_info.get("index") if isinstance(extra_info, dict) else None
        row["index"] = index if given_index is None else given_index
        if self.tag_files:
            row["data_file"] = self.file_of(index)
        if self.tools:  # multi-turn: each tool's create/execute kwargs for this sample
            tools_kwargs = extra_info.get("tools_kwargs") if isinstance(extra_info, dict) else None
            row["tools_kwargs"] = tools_kwargs or {}
            # what the agent loop's environment / simulated user reads of the row
            row["agent_kwargs"] = {"data_source": row.get(self.reward_fn_key), "agent_name": row.get("agent_name"),
                                   "extra_info": extra_info if isinstance(extra_info, dict) else {},
                                   "prompt": messages}
        return row

    # ---- loading ---------------------------------------------------------------------------------

    def _read(self, path: str, files_key: str) -> pa.Table:
        """Read one data file (any format `sources` takes) and check it as `check_prompt_table` does."""
        table = read_table(path, files_key, split=self.split, split_key=self.split_key)
        check_prompt_table(table, path, files_key, self.prompt_key, self.reward_fn_key)
        return table

    def file_of(self, index: int) -> int:
        """The position in `files` of the file the sample at `index` (after filtering) comes from."""
        row = index if self._kept is None else self._kept[index]
        return bisect.bisect_right(self._file_starts, row) - 1

    def item_files(self) -> list[int]:
        """`file_of` every sample, in order (a mixture's sampler draws from each file's samples)."""
        rows = np.arange(len(self)) if self._kept is None else np.asarray(self._kept)
        return (np.searchsorted(np.asarray(self._file_starts), rows, side="right") - 1).tolist()

    def _where(self, index: int) -> str:
        """File and row of the sample at `index` (after filtering)."""
        row = index if self._kept is None else self._kept[index]
        file = self.file_of(index)
        return f"{self.files_key}: {describe_row(self.files[file], row - self._file_starts[file])}"

    def _check_images(self) -> bool:
        """Whether the data has images (a non-empty ``data.image_key`` column); then the model must have a
        processor for them."""
        if self.image_key not in self._table.column_names:
            return False
        column = self._table.column(self.image_key).combine_chunks()
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise DataError(f"{self.files_key}: column {self.image_key!r} (data.image_key) is {column.type}, not a "
                            "list of images per row; store a list (bytes, paths or {'bytes', 'path'} structs)")
        if not pc.sum(pc.list_value_length(column).fill_null(0)).as_py():
            return False
        if self.processor is None:
            name = getattr(self.tokenizer, "name_or_path", "")
            raise ConfigError(
                f"{self.files_key} has images (column {self.image_key!r}, data.image_key) but the model ({name}) has "
                "no image processor (no preprocessor_config.json in its folder): a text-only model cannot read them. "
                "Use a vision-language model folder with its processor files, or drop the images column"
            )
        return True

    def _encode_with_images(self, messages: list[dict[str, Any]], images: list[Any] | None,
                            index: int) -> tuple[list[int], dict[str, torch.Tensor], dict[str, list]]:
        """Ids (image tokens expanded), vision inputs and the sampler's images of one prompt."""
        where = lambda: self._where(index)  # noqa: E731 - the row is named only on an error
        images = [decode_image(image, where) for image in images or []]
        messages = split_image_placeholders(messages, len(images), where)
        text = self._render(messages, index)
        try:
            encoded = self.processor(text=[text], images=images or None, return_tensors="pt")
        except ValueError as err:  # e.g. an image smaller than a merged patch, or far too long and thin
            raise DataError(f"{where()}: the processor rejects the row's images ({err}); fix or drop the row") from None
        ids = encoded["input_ids"][0].tolist()
        if not images:
            return ids, {}, {}
        inputs = {"pixel_values": encoded["pixel_values"], "image_grid_thw": encoded["image_grid_thw"]}
        return ids, inputs, {"image": images}

    def _lengths(self, table: pa.Table | None = None, first: int = 0) -> list[int]:
        """Token count of every templated prompt of `table` (the dataset's by default; its rows are samples
        `first`, `first` + 1, ...), image tokens included."""
        table = self._table if table is None else table
        if self.has_images:
            rows = table.select([self.prompt_key, self.image_key]).to_pylist()
            return [len(self._encode_with_images(r[self.prompt_key], r[self.image_key], first + i)[0])
                    for i, r in enumerate(rows)]
        prompts = table.column(self.prompt_key).to_pylist()
        texts = [self._render(messages, first + i) for i, messages in enumerate(prompts)]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _check_lengths(self, table: pa.Table | None = None, start: int = 0) -> None:
        """With truncation=error and no filter: no prompt longer than ``max_prompt_length`` (else the run
        would stop at the batch that holds it, hours in). `table`, `start`: as `_lengths`'."""
        lengths = self._lengths(table, start)
        overlong = [i for i, length in enumerate(lengths) if length > self.max_prompt_length]
        if overlong:
            first = overlong[0]
            sample = start + first
            raise DataError(
                f"{self._where(sample)}: the prompt of sample {sample} is {lengths[first]} tokens, longer than "
                f"data.max_prompt_length={self.max_prompt_length} ({len(overlong)} of {len(lengths)} prompts are); "
                + ("raise data.max_prompt_length, set data.filter_overlong_prompts=true to drop such prompts, or set "
                   "data.truncation to left, right or middle" if not self.has_images else
                   "raise data.max_prompt_length or set data.filter_overlong_prompts=true to drop such prompts "
                   "(prompts with images are not truncated: a cut would split an image's tokens)")
            )

    def _drop_overlong(self) -> None:
        """Drop rows whose templated prompt is longer than ``max_prompt_length`` tokens."""
        lengths = self._lengths()
        keep = [i for i, length in enumerate(lengths) if length <= self.max_prompt_length]
        self.num_filtered = len(lengths) - len(keep)
        if not keep:
            raise DataError(
                f"{self.files_key} ({', '.join(self.files)}): all {len(lengths)} prompts are longer than "
                f"data.max_prompt_length={self.max_prompt_length} tokens (the shortest has {min(lengths, default=0)}); "
                "raise data.max_prompt_length"
            )
        if self.num_filtered:
            self._table = self._table.take(pa.array(keep, type=pa.int64()))
            self._kept = keep
            logger.warning(
                "RLHFDataset %s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens "
                "(data.filter_overlong_prompts=true)",
                self.files,
                self.num_filtered,
                len(lengths),
                self.max_prompt_length,
            )

    # ---- per item --------------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], index: int) -> str:
        """The prompt of sample `index` through the chat template."""
        kwargs: dict[str, Any] = {"chat_template": self.chat_template} if self.chat_template else {}
        if self.tools:
            kwargs["tools"] = self.tools
        return apply_chat_template(self.tokenizer, messages, lambda: self._where(index), add_generation_prompt=True,
                                   tokenize=False, **kwargs)

    def _encode(self, messages: list[dict[str, Any]], index: int) -> list[int]:
        return self.tokenizer(self._render(messages, index), add_special_tokens=False)["input_ids"]

    def _truncate(self, ids: list[int], index: int) -> list[int]:
        limit = self.max_prompt_length
        if len(ids) <= limit:
            return ids
        if self.has_images:  # a cut through an image's tokens would leave tokens without their patches
            raise DataError(
                f"{self._where(index)}: the prompt of sample {index} is {len(ids)} tokens with its image tokens, "
                f"longer than data.max_prompt_length={limit}, and prompts with images are not truncated; raise "
                "data.max_prompt_length or set data.filter_overlong_prompts=true")
        if self.truncation == "left":
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        if self.truncation == "middle":
            head = limit // 2
            return ids[:head] + ids[len(ids) - (limit - head) :]
        raise DataError(
            f"{self._where(index)}: the prompt of sample {index} is {len(ids)} tokens, longer than "
            f"data.max_prompt_length={limit}; raise data.max_prompt_length, set data.filter_overlong_prompts=true to "
            "drop such prompts, or set data.truncation to left, right or middle"
        )


_LEFT_PADDED = ("input_ids", "attention_mask", "position_ids")


def collate_fn(items: list[dict[str, Any]]) -> dict[str, torch.Tensor | np.ndarray]:
    """Stack tensors along a new dim 0; gather everything else into numpy object arrays (one entry
    per item), so that ``DataProto.from_single_dict`` splits them into batch and non-tensor batch.

    The prompts come left-padded to ``max_prompt_length``; columns that are padding in every row of
    the batch are dropped, so the batch is as wide as its longest prompt. Every forward pass of the
    step (old log-probs, reference, update) then skips that padding instead of computing it.
    """
    batch: dict[str, torch.Tensor | np.ndarray] = {}
    for key in items[0]:
        values = [item[key] for item in items]
        if isinstance(values[0], torch.Tensor):
            batch[key] = torch.stack(values)
        else:
            # Element by element: np.array(list_of_equal_length_lists) would build a 2-D array.
            array = np.empty(len(values), dtype=object)
            for i, value in enumerate(values):
                array[i] = value
            batch[key] = array
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > 1:
        used = mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else mask.shape[1] - 1  # keep one column for empty prompts
        for key in _LEFT_PADDED:
            if isinstance(batch.get(key), torch.Tensor):
                batch[key] = batch[key][:, first:].contiguous()
    return batch


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], where: Callable[[], str], **kwargs: Any) -> Any:
    """`tokenizer.apply_chat_template(messages, **kwargs)`, its failures the user's to fix: a template that
    does not compile is a `ConfigError` (data.chat_template, or the tokenizer's own), one that fails on
    these messages a `DataError` naming the row (`where()`: file and row)."""
    from jinja2 import TemplateSyntaxError

    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except TemplateSyntaxError as err:
        source = ("data.chat_template" if kwargs.get("chat_template")
                  else "the chat template (data.chat_template, or the tokenizer's own)")
        raise ConfigError(f"{source} is not a valid Jinja template (line {err.lineno}: {err.message}); fix it, or "
                          "set data.chat_template to one that is") from None
    except Exception as err:  # noqa: BLE001 - whatever the template raises on these messages
        raise DataError(f"{where()}: the chat template fails on its messages ({type(err).__name__}: {err}); fix "
                        "the row, or set data.chat_template to a template that takes it") from None


def check_prompt_table(table: pa.Table, path: str, files_key: str, prompt_key: str, reward_fn_key: str,
                       first_row: int = 0) -> None:
    """The columns the trainer and reward need, and every prompt a non-empty list of messages with a role and a
    content (the chat template would fail on a null one, mid-run, with an error naming neither the file nor the
    row). `table` holds the file's rows from `first_row` on (a piece of a streamed file); errors name the file and
    the row in it. One check for every format: the readers give the same table for the same rows."""
    schema = table.schema
    columns = schema.names

    def schema_error(what: str) -> DataError:
        return DataError(f"{files_key}: {path}: {what}; the file has columns {columns}")

    if prompt_key not in columns:
        raise schema_error(f"no prompt column {prompt_key!r} (data.prompt_key), which must name the column of chat "
                           "messages")
    prompt_type = schema.field(prompt_key).type
    if not (
        (pa.types.is_list(prompt_type) or pa.types.is_large_list(prompt_type))
        and pa.types.is_struct(prompt_type.value_type)
        and {"role", "content"} <= {field.name for field in prompt_type.value_type}
    ):
        raise schema_error(
            f"column {prompt_key!r} is {prompt_type}, not chat messages; store a list of "
            "{'role': ..., 'content': ...} dicts, e.g. [{'role': 'user', 'content': question}]"
        )
    if reward_fn_key not in columns:
        raise schema_error(f"no column {reward_fn_key!r} (data.reward_fn_key)")
    if "reward_model" not in columns:
        raise schema_error("no column 'reward_model' (a struct with 'ground_truth')")
    reward_type = schema.field("reward_model").type
    if not (pa.types.is_struct(reward_type) and reward_type.get_field_index("ground_truth") >= 0):
        raise schema_error(f"column 'reward_model' is {reward_type}, not a struct with 'ground_truth'")

    prompts = table.column(prompt_key).combine_chunks()
    empty = pc.or_kleene(pc.is_null(prompts), pc.equal(pc.list_value_length(prompts), 0)).fill_null(True)
    if pc.any(empty).as_py():
        row = first_row + pc.index(empty, True).as_py()
        raise DataError(f"{files_key}: {describe_row(path, row)}: column {prompt_key!r} holds no messages; give every "
                        "row at least one {'role': ..., 'content': ...} message, or drop the row")
    messages = prompts.flatten()
    for field in ("role", "content"):
        missing = pc.is_null(pc.struct_field(messages, field))
        if pc.any(missing).as_py():
            row = first_row + pc.list_parent_indices(prompts)[pc.index(missing, True).as_py()].as_py()
            raise DataError(f"{files_key}: {describe_row(path, row)}: a message of column {prompt_key!r} has no "
                            f"{field!r} (null); give every message a role and a content, or drop the row")
