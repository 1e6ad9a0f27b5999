"""A remote teacher (`teacher.url`): an OpenAI-compatible server (`vllm serve MODEL`) scores the student's
tokens by its prompt log-probs, so the teacher need not fit beside the student.

Each row goes to `/v1/completions` as token ids (prompt + response exactly as sampled: nothing is decoded),
with `prompt_logprobs=k` and one generated token (discarded). Entry j of the answer's `prompt_logprobs` holds
log p(ids[j] | ids[:j]) for the token itself and the server's k most likely tokens at j, which gives the
sampled token's log-prob and, with the JSD term, the teacher's top-k, at the raw logits (temperature 1; the
config check refuses another teacher temperature). Before training, `check_remote_teacher` probes the server
with a short timeout (a dead URL stops the run there, naming the key) and checks that it tokenizes a probe
string as the student's tokenizer does (its `/tokenize`) and decodes ids spread over the student's whole
vocabulary to the same text (its `/detokenize`), since it reads the student's ids.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import torch

from hflow.config_schema import ConfigError
from hflow.protocol import DataProto

__all__ = ["RemoteTeacher", "check_remote_teacher"]

# tokenized both ways: digits, spaces, punctuation and non-ASCII, where tokenizers differ first
PROBE = "Teacher probe: 12 + 30 = 42. Naïve café, über-fast; (x^2)!"
VOCAB_SAMPLES = 64  # token ids, spread over the student's vocabulary, decoded both ways
ROWS_PER_REQUEST = 16  # rows sent in one request (the server batches them)


def http_json(url: str, body: dict[str, Any] | None, timeout: float) -> Any:
    """GET (body None) or POST a JSON body; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def served_model(teacher: Any) -> str:
    """The model name to ask for: `teacher.url_model`, checked to be served, else the server's first."""
    url = str(teacher.url).rstrip("/")
    try:
        names = [m["id"] for m in http_json(f"{url}/v1/models", None, float(teacher.url_timeout_s))["data"]]
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"teacher.url={teacher.url} does not answer GET /v1/models within "
                          f"teacher.url_timeout_s={teacher.url_timeout_s} s ({type(err).__name__}: {err}); start the "
                          "server (e.g. `vllm serve MODEL`), or fix teacher.url") from None
    if teacher.url_model is not None and teacher.url_model not in names:
        raise ConfigError(f"teacher.url_model={teacher.url_model} is not served at teacher.url={teacher.url} "
                          f"(it serves {names}); set teacher.url_model to one of them, or null")
    if not names:
        raise ConfigError(f"teacher.url={teacher.url} serves no model (GET /v1/models is empty)")
    return str(teacher.url_model or names[0])


def check_remote_teacher(teacher: Any, tokenizer, topk: int = 0) -> str:
    """Preflight: the server answers (short timeout), tokenizes `PROBE` to the student's ids, decodes the
    student's ids as the student does, and scores a prompt with `prompt_logprobs=topk` (the JSD term's k; vLLM
    caps it at its `--max-logprobs`). Returns the served model's name."""
    model = served_model(teacher)
    url = str(teacher.url).rstrip("/")
    body = {"model": model, "prompt": PROBE, "add_special_tokens": False}
    try:
        served = http_json(f"{url}/tokenize", body, float(teacher.url_timeout_s))["tokens"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"teacher.url={teacher.url}: POST /tokenize failed ({type(err).__name__}: {err}); the "
                          "student's tokenizer is checked against the server's there (vllm serve has it)") from None
    local = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    if list(served) != list(local):
        raise ConfigError(f"the server at teacher.url={teacher.url} ({model}) tokenizes {PROBE!r} as {served[:12]}..., "
                          f"the student's tokenizer as {local[:12]}...; the teacher scores the student's token ids, so "
                          "serve a model with the student's tokenizer")
    # a probe string reaches only common ids: ids spread over the student's whole vocabulary, up to its last,
    # must decode to the same text there (a smaller or reordered vocabulary does not)
    size = len(tokenizer)
    ids = sorted({round(i * (size - 1) / (VOCAB_SAMPLES - 1)) for i in range(VOCAB_SAMPLES)})
    # and the first id past the student's last must mean nothing there: the server's top-k could name it
    try:
        text, beyond = (http_json(f"{url}/detokenize", {"model": model, "tokens": tokens},
                                  float(teacher.url_timeout_s))["prompt"] for tokens in (ids, [size]))
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"the server at teacher.url={teacher.url} ({model}) cannot decode the student's token ids "
                          f"up to {size - 1} ({type(err).__name__}: {err}); serve a model with the student's "
                          "tokenizer") from None
    if text != tokenizer.decode(ids):
        raise ConfigError(f"the server at teacher.url={teacher.url} ({model}) decodes the student's token ids "
                          f"{ids[-4:]} to other text than the student's tokenizer does; serve a model with the "
                          "student's tokenizer")
    if beyond:
        raise ConfigError(f"the server at teacher.url={teacher.url} ({model}) has a token {beyond!r} at id {size}, past "
                          f"the student's last token id {size - 1}: its vocabulary is larger than the student's "
                          "tokenizer's; serve a model with the student's tokenizer")
    body = {"model": model, "prompt": [local], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": topk}
    try:
        http_json(f"{url}/v1/completions", body, max(float(teacher.url_timeout_s), 60.0))
    except (urllib.error.URLError, OSError, ValueError) as err:
        detail = err.read().decode(errors="replace")[:300] if isinstance(err, urllib.error.HTTPError) else err
        raise ConfigError(f"the server at teacher.url={teacher.url} ({model}) does not score a prompt with "
                          f"prompt_logprobs={topk} ({detail}); with algorithm.distill.jsd_coef > 0 that is "
                          "teacher.topk: lower it, or start vLLM with --max-logprobs >= it") from None
    return model


class RemoteTeacher:
    """The teacher worker's answer (`teacher_log_prob`, with `topk` also `teacher_topk_ids` and
    `teacher_topk_log_probs`), computed by the server at `teacher.url`."""

    def __init__(self, teacher: Any, model: str):
        self.url = str(teacher.url).rstrip("/") + "/v1/completions"
        self.model = model
        self.timeout = float(teacher.url_timeout_s)

    def score(self, data: DataProto, topk: int) -> DataProto:
        responses, attention = data.batch["responses"], data.batch["attention_mask"].bool()
        batch_size, length = responses.shape
        log_probs = torch.zeros(batch_size, length)
        ids_out = torch.zeros(batch_size, length, max(topk, 1), dtype=torch.int32)
        topk_out = torch.zeros(batch_size, length, max(topk, 1))
        rows = [data.batch["input_ids"][i][attention[i]].tolist() for i in range(batch_size)]
        sampled = attention[:, -length:].sum(-1).tolist()  # responses are right-padded: their first n tokens
        for start in range(0, batch_size, ROWS_PER_REQUEST):
            chunk = rows[start:start + ROWS_PER_REQUEST]
            body = {"model": self.model, "prompt": chunk, "max_tokens": 1, "temperature": 1.0,
                    "prompt_logprobs": topk}
            # a long batch may take a while on the server: the timeout bounds the connection, not the scoring
            choices = sorted(http_json(self.url, body, max(self.timeout, 600.0))["choices"], key=lambda c: c["index"])
            for offset, choice in enumerate(choices):
                i = start + offset
                entries = choice["prompt_logprobs"][len(chunk[offset]) - sampled[i]:]
                for t, entry in enumerate(entries):
                    log_probs[i, t] = entry[str(int(responses[i, t]))]["logprob"]
                    if topk > 0:
                        best = sorted((v["rank"], int(k), v["logprob"]) for k, v in entry.items() if v["rank"] <= topk)
                        ids_out[i, t] = torch.tensor([b[1] for b in best[:topk]], dtype=torch.int32)
                        topk_out[i, t] = torch.tensor([b[2] for b in best[:topk]])
        columns = {"teacher_log_prob": log_probs}
        if topk > 0:
            columns.update(teacher_topk_ids=ids_out, teacher_topk_log_probs=topk_out)
        return DataProto.from_dict(columns)
