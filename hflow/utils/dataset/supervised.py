"""Datasets of the supervised stages: demonstrations (SFT), preferences (reward model) and preference
pairs for DPO.

Both tokenise every row when built, on the driver, so that bad data stops the run before any worker or
model starts, with the file, the column and the row named. A response is encoded the way the policy
produces it in RL: the prompt rendered by the chat template with its generation prompt, then the
response's tokens up to and including the end-of-turn token (the template's tokens after it, e.g.
ChatML's newline, are context for a later turn, never a target). So the reward model is trained on
exactly the token layout it scores in PPO, and the SFT policy learns to stop where generation stops.

* `SFTDataset`: a ``messages`` column (chat: user/assistant/system turns) or ``prompt`` + ``response``
  columns. Loss only on assistant tokens (``loss_mask``).
* `PreferenceDataset`: ``prompt``, ``chosen``, ``rejected`` (pairwise), or ``prompt``, ``responses`` (a
  list of K texts) and ``label`` (the index of the preferred one; lm-human-preferences' K-way form).
  A row is a group of K sequences, the preferred one first-class in ``preferred_mask``.
* `DPODataset`: ``chosen`` and ``rejected``, each a text after a ``prompt`` column, or chat messages
  ending with the assistant's reply (after the prompt column if there is one and they do not already
  start with it; without it the messages before the reply are the prompt, and must be the same in both). A row is two sequences, chosen first,
  with ``loss_mask`` on the reply's tokens (what DPO's log-probabilities sum over). Rows whose two replies
  are identical stop the run, counted and named: they carry no preference; so does an empty reply.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hflow.utils.dataset.rl_dataset import apply_chat_template
from hflow.utils.dataset.sources import read_table, resolve_files, row_namer, split_for
from hflow.utils.errors import ConfigError, DataError

__all__ = ["DPODataset", "PreferenceDataset", "SFTDataset", "encode_turn", "pair_collate_fn", "preference_collate_fn",
           "sft_collate_fn"]

logger = logging.getLogger(__name__)


def _ids(encoded: Any) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _as_chat(prompt: Any, where: str) -> list[dict[str, str]]:
    """A prompt cell as chat messages: a string becomes one user turn."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple, np.ndarray)) and all(isinstance(m, dict) for m in prompt):
        return [dict(m) for m in prompt]
    raise DataError(f"{where}: a prompt must be a string or a list of {{role, content}} messages, "
                    f"got {type(prompt).__name__}")


def _use_chat_template(tokenizer, template: str | None) -> None:
    """`data.chat_template` when set, else the tokenizer's own, which it must have."""
    if template:
        tokenizer.chat_template = template
    elif not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"the tokenizer ({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}) has no chat "
                          "template; set data.chat_template to a Jinja chat template, or use a model folder whose "
                          "tokenizer has one")


def _render_ids(tokenizer, chat: list[dict[str, str]], where: str, **kwargs: Any) -> list[int]:
    return _ids(apply_chat_template(tokenizer, chat, lambda: where, tokenize=True, **kwargs))


def encode_turn(tokenizer, context: list[dict[str, str]], reply: str, where: str) -> tuple[list[int], list[int]]:
    """(context ids with the generation prompt, reply ids up to and including the end-of-turn token)."""
    prefix = _render_ids(tokenizer, context, where, add_generation_prompt=True)
    full = _render_ids(tokenizer, context + [{"role": "assistant", "content": reply}], where)
    if full[: len(prefix)] != prefix:
        raise DataError(
            f"{where}: the tokenizer's chat template renders a conversation so that its beginning changes when an "
            "assistant turn is added; the assistant tokens cannot be located. Set data.chat_template to a template "
            "without that property (e.g. ChatML)")
    reply_ids = full[len(prefix):]
    eos = tokenizer.eos_token_id
    if eos in reply_ids:  # what follows the end-of-turn token belongs to the template, not the reply
        reply_ids = reply_ids[: reply_ids.index(eos) + 1]
    return prefix, reply_ids


def _check_columns(table, needed: list[str], path: str, files_key: str, hint: str) -> None:
    missing = [c for c in needed if c not in table.column_names]
    if missing:
        raise DataError(f"{files_key}: {path} has no column {', '.join(repr(c) for c in missing)} "
                        f"(columns: {', '.join(table.column_names)}); {hint}")


def _fit(ids: list[int], max_length: int, truncation: str, where: str, keep: str) -> list[int]:
    if len(ids) <= max_length:
        return ids
    if truncation == "error":
        raise DataError(f"{where} is {len(ids)} tokens long, more than data.max_length={max_length}; raise "
                        f"data.max_length or set data.truncation={keep}")
    return ids[:max_length] if keep == "right" else ids[-max_length:]


class SFTDataset(Dataset):
    """Demonstrations: rows of `input_ids` and `loss_mask` (1 on assistant tokens), tokenised at build."""

    def __init__(self, data_files: Any, tokenizer, config, files_key: str = "data.train_files"):
        self.tokenizer = tokenizer
        self.rows: list[tuple[list[int], list[int]]] = []
        _use_chat_template(tokenizer, config.chat_template)
        for path in resolve_files(data_files, files_key):
            self._read(path, files_key, config)
        if not self.rows:
            raise DataError(f"{files_key}: no rows in {data_files}")

    def _read(self, path: str, files_key: str, cfg) -> None:
        table = read_table(path, files_key, None, *split_for(cfg, files_key))
        name = row_namer(path)
        if table.num_rows == 0:
            raise DataError(f"{files_key}: {path} has no rows")
        if cfg.messages_key in table.column_names:
            chats = table.column(cfg.messages_key).to_pylist()
        else:
            _check_columns(table, [cfg.prompt_key, cfg.response_key], path, files_key,
                           f"give a chat column data.messages_key={cfg.messages_key!r}, or prompt and response columns "
                           f"(data.prompt_key, data.response_key)")
            chats = [_as_chat(p, f"{name(i)} column {cfg.prompt_key!r}") + [{"role": "assistant", "content": r}]
                     for i, (p, r) in enumerate(zip(table.column(cfg.prompt_key).to_pylist(),
                                                     table.column(cfg.response_key).to_pylist()))]
        for i, chat in enumerate(chats):
            where = name(i)
            self.rows.append(self._encode(_as_chat(chat, f"{where} column {cfg.messages_key!r}"), where, cfg))

    def _encode(self, chat: list[dict[str, str]], where: str, cfg) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        for turn, message in enumerate(chat):
            if message.get("role") != "assistant":
                continue
            if not isinstance(message.get("content"), str):
                raise DataError(f"{where}: assistant turn {turn} has no text content")
            prefix, reply = encode_turn(self.tokenizer, chat[:turn], message["content"], where)
            if prefix[: len(ids)] != ids:
                raise DataError(f"{where}: the chat template renders earlier turns differently once later turns "
                                "follow; set data.chat_template to a template without that property (e.g. ChatML)")
            mask += [0] * (len(prefix) - len(ids)) + [1] * len(reply)
            ids = prefix + reply
        if not any(mask):
            raise DataError(f"{where}: no assistant turn to learn from (column {cfg.messages_key!r} needs at least one "
                            "message with role 'assistant')")
        ids = _fit(ids, cfg.max_length, cfg.truncation, where, keep="right")
        return ids, mask[: len(ids)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids, mask = self.rows[index]
        return {"input_ids": ids, "loss_mask": mask}


def _pad_right(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
    return ids, attention


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def sft_collate_fn(pad_token_id: int):
    """Right-padded tensors: input_ids, attention_mask, position_ids, loss_mask (targets are tokens t)."""

    def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids, attention = _pad_right([item["input_ids"] for item in items], pad_token_id)
        loss_mask = torch.zeros_like(ids)
        for i, item in enumerate(items):
            loss_mask[i, : len(item["loss_mask"])] = torch.tensor(item["loss_mask"])
        return {"input_ids": ids, "attention_mask": attention, "position_ids": _position_ids(attention),
                "loss_mask": loss_mask}

    return collate


class PreferenceDataset(Dataset):
    """Groups of K responses to one prompt and which one is preferred (pairwise: K=2, chosen first)."""

    def __init__(self, data_files: Any, tokenizer, config, files_key: str = "data.train_files"):
        self.tokenizer = tokenizer
        _use_chat_template(tokenizer, config.chat_template)
        self.groups: list[tuple[list[list[int]], int]] = []
        self.num_dropped_ties = 0
        for path in resolve_files(data_files, files_key):
            self._read(path, files_key, config)
        sizes = {len(seqs) for seqs, _ in self.groups}
        if len(sizes) > 1:
            raise DataError(f"{files_key}: rows have different numbers of responses {sorted(sizes)}; every row of "
                            "a preference data set needs the same K")
        self.group_size = sizes.pop()

    def _read(self, path: str, files_key: str, cfg) -> None:
        table = read_table(path, files_key, None, *split_for(cfg, files_key))
        name = row_namer(path)
        if table.num_rows == 0:
            raise DataError(f"{files_key}: {path} has no rows")
        kway = cfg.responses_key in table.column_names
        hint = (f"pairwise data needs {cfg.prompt_key!r}, {cfg.chosen_key!r}, {cfg.rejected_key!r}; K-way data "
                f"needs {cfg.prompt_key!r}, {cfg.responses_key!r} (a list of texts) and {cfg.label_key!r} "
                "(the index of the preferred one); rename with data.*_key")
        if kway:
            _check_columns(table, [cfg.prompt_key, cfg.label_key], path, files_key, hint)
            rows = zip(table.column(cfg.responses_key).to_pylist(), table.column(cfg.label_key).to_pylist())
        else:
            _check_columns(table, [cfg.prompt_key, cfg.chosen_key, cfg.rejected_key], path, files_key, hint)
            rows = (([c, r], 0) for c, r in zip(table.column(cfg.chosen_key).to_pylist(),
                                                  table.column(cfg.rejected_key).to_pylist()))
        before = len(self.groups)
        ties = 0
        for i, (prompt, (responses, label)) in enumerate(zip(table.column(cfg.prompt_key).to_pylist(), rows)):
            where = name(i)
            column = cfg.responses_key if kway else f"{cfg.chosen_key}/{cfg.rejected_key}"
            if not isinstance(responses, list) or len(responses) < 2 or not all(isinstance(r, str) for r in responses):
                raise DataError(f"{where} column {column!r}: needs at least two response texts")
            if not isinstance(label, int) or not 0 <= label < len(responses):
                raise DataError(f"{where} column {cfg.label_key!r}: {label!r} is not an index into its "
                                f"{len(responses)} responses")
            if all(r == responses[label] for r in responses):
                ties += 1  # nothing to prefer: no gradient, and a coin flip in the accuracy
                continue
            chat = _as_chat(prompt, f"{where} column {cfg.prompt_key!r}")
            seqs = []
            for response in responses:
                prefix, reply = encode_turn(tokenizer=self.tokenizer, context=chat, reply=response, where=where)
                # left truncation keeps the responses, which are what is being compared
                seqs.append(_fit(prefix + reply, cfg.max_length, cfg.truncation, where, keep="left"))
            self.groups.append((seqs, label))
        if len(self.groups) == before:
            raise DataError(f"{files_key}: in {path} every row's responses are identical ({column!r}: the chosen text "
                            "equals the rejected one); a preference needs two different responses")
        if ties:
            self.num_dropped_ties += ties
            logger.warning("%s: dropped %d of %d rows whose responses are identical (column %r)", path, ties,
                           table.num_rows, column)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> dict[str, Any]:
        seqs, label = self.groups[index]
        return {"sequences": seqs, "label": label}


def preference_collate_fn(pad_token_id: int):
    """Groups flattened row-wise (group g's K sequences are rows gK .. gK+K-1), right-padded, with
    `preferred_mask` marking each group's preferred row."""

    def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = [s for item in items for s in item["sequences"]]
        ids, attention = _pad_right(seqs, pad_token_id)
        k = len(items[0]["sequences"])
        preferred = torch.zeros(len(seqs), dtype=torch.long)
        preferred[torch.tensor([g * k + item["label"] for g, item in enumerate(items)])] = 1
        return {"input_ids": ids, "attention_mask": attention, "position_ids": _position_ids(attention),
                "preferred_mask": preferred}

    return collate


class DPODataset(Dataset):
    """Preference pairs: per row the chosen and the rejected reply to one conversation, each encoded as PPO
    sees a response (`encode_turn`), with `loss_mask` 1 on the reply's tokens through its end-of-turn token."""

    def __init__(self, data_files: Any, tokenizer, config, files_key: str = "data.train_files"):
        self.tokenizer = tokenizer
        _use_chat_template(tokenizer, config.chat_template)
        self.pairs: list[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]] = []
        for path in resolve_files(data_files, files_key):
            self._read(path, files_key, config)

    def _read(self, path: str, files_key: str, cfg) -> None:
        table = read_table(path, files_key, None, *split_for(cfg, files_key))
        name = row_namer(path)
        if table.num_rows == 0:
            raise DataError(f"{files_key}: {path} has no rows")
        _check_columns(table, [cfg.chosen_key, cfg.rejected_key], path, files_key,
                       f"DPO needs the preferred reply in {cfg.chosen_key!r} and the other in {cfg.rejected_key!r} (text "
                       f"after a {cfg.prompt_key!r} column, or chat messages ending with the reply); rename with "
                       "data.chosen_key / data.rejected_key")
        has_prompt = cfg.prompt_key in table.column_names
        prompts = table.column(cfg.prompt_key).to_pylist() if has_prompt else [None] * table.num_rows
        identical = []
        for i, (prompt, chosen, rejected) in enumerate(zip(prompts, table.column(cfg.chosen_key).to_pylist(),
                                                           table.column(cfg.rejected_key).to_pylist())):
            where = name(i)
            context, chosen_reply = self._conversation(prompt, chosen, f"{where} column {cfg.chosen_key!r}", cfg)
            other, rejected_reply = self._conversation(prompt, rejected, f"{where} column {cfg.rejected_key!r}", cfg)
            for key, reply in ((cfg.chosen_key, chosen_reply), (cfg.rejected_key, rejected_reply)):
                if not reply.strip():  # only the end-of-turn token to compare: a pair of nothing
                    raise DataError(f"{files_key}: {name(i)} column {key!r}: the reply is empty; a pair needs "
                                    "two replies with text: remove the row or fill in its reply")
            if other != context:
                raise DataError(f"{where}: the conversation before the reply differs between {cfg.chosen_key!r} and "
                                f"{cfg.rejected_key!r}; a pair is two replies to the same prompt")
            if chosen_reply == rejected_reply:
                identical.append(i)  # no preference to learn: counted and refused below, never trained on
                continue
            self.pairs.append((self._encode(context, chosen_reply, where, cfg),
                               self._encode(context, rejected_reply, where, cfg)))
        if identical:
            shown = ", ".join(map(str, identical[:10])) + (", ..." if len(identical) > 10 else "")
            raise DataError(f"{files_key}: {path} has {len(identical)} of {table.num_rows} rows whose {cfg.chosen_key!r} "
                            f"and {cfg.rejected_key!r} replies are identical (rows {shown}); a pair needs two different "
                            "replies: remove those rows")

    def _conversation(self, prompt: Any, response: Any, where: str, cfg) -> tuple[list[dict[str, str]], str]:
        """(the messages before the reply, the reply's text) of one cell."""
        if isinstance(response, str):
            if prompt is None:
                raise DataError(f"{where}: a text reply needs the prompt in a {cfg.prompt_key!r} column (data.prompt_key), "
                                "or give chat messages that end with the reply")
            return _as_chat(prompt, f"{where} (prompt)"), response
        messages = _as_chat(response, where) if isinstance(response, (list, tuple, np.ndarray)) else None
        if not messages or messages[-1].get("role") != "assistant" or not isinstance(messages[-1].get("content"), str):
            raise DataError(f"{where}: a reply must be a text or chat messages ending with an assistant message, "
                            f"got {type(response).__name__}")
        context = messages[:-1]
        if prompt is not None:
            prompt_chat = _as_chat(prompt, f"{where} (prompt)")
            if context[: len(prompt_chat)] != prompt_chat:  # the messages continue the prompt (else they repeat
                context = prompt_chat + context            # it, as UltraFeedback's do: not twice)
        if not context:
            raise DataError(f"{where}: the messages hold only the reply; give the prompt in a {cfg.prompt_key!r} column "
                            "or as the messages before the reply")
        return context, messages[-1]["content"]

    def _encode(self, context: list[dict[str, str]], reply: str, where: str, cfg) -> tuple[list[int], list[int]]:
        prefix, reply_ids = encode_turn(self.tokenizer, context, reply, where)
        # left truncation keeps the replies, which are what is being compared
        ids = _fit(prefix + reply_ids, cfg.max_length, cfg.truncation, where, keep="left")
        return ids, ([0] * len(prefix) + [1] * len(reply_ids))[-len(ids):]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"pair": self.pairs[index]}


def pair_collate_fn(pad_token_id: int):
    """Pairs flattened row-wise (pair g's chosen is row 2g, its rejected row 2g+1), right-padded, with
    `loss_mask` on each reply's tokens."""

    def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [row for item in items for row in item["pair"]]
        ids, attention = _pad_right([row_ids for row_ids, _ in rows], pad_token_id)
        loss_mask = torch.zeros_like(ids)
        for i, (_, mask) in enumerate(rows):
            loss_mask[i, : len(mask)] = torch.tensor(mask)
        return {"input_ids": ids, "attention_mask": attention, "position_ids": _position_ids(attention),
                "loss_mask": loss_mask}

    return collate
