"""Tests of the built-in agentic task and model (hflow.tasks.agent_task).

All but one use QUICK_AGENT_SPEC, a seconds-long build with the same structure as the default.
`test_default_assets_meet_the_targets` checks the default model's measured rates (its info file),
building the default assets into the cache first if they are not there (about a minute and a half on
one core, instant afterwards).
"""

import dataclasses
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from hflow.agent.chat import ToolMessageEncoder
from hflow.tasks import agent_task as at
from hflow.tasks import assets
from hflow.tasks import builtin_task as bt
from hflow.tasks.tiny_models import VLLM_CPU_HEAD_SIZES, build_tokenizer
from hflow.reward.score.arithmetic import compute_score
from tests.conftest import REPO_ROOT
from tests.tasks.test_builtin_task import _hashes, _mtimes

QUICK = at.QUICK_AGENT_SPEC
P = at.Multiplication(37, 86)


@pytest.fixture(scope="module")
def quick_assets(tmp_path_factory) -> at.AgentAssets:
    return at.ensure_agent_assets(tmp_path_factory.mktemp("cache"), spec=QUICK)


@pytest.fixture(scope="module")
def tokenizer(quick_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(quick_assets.model_path)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------ the task


def test_problems_and_split():
    problems = at.multiplication_problems()
    assert len(problems) == len(set(problems)) == 8100
    assert {p.a for p in problems} == {p.b for p in problems} == set(range(10, 100))
    assert (P.question, P.expression, P.answer, P.guess) == ("What is 37 * 86?", "37 * 86", 3182, 2400)
    assert all(p.guess != p.answer for p in problems)  # the corpus never guesses right
    assert at.Multiplication(30, 80).guess == 2500
    train, val = at.split_multiplications(problems, 200)
    assert (len(train), len(val)) == (7900, 200)
    assert not set(train) & set(val) and set(train) | set(val) == set(problems)
    assert at.split_multiplications(problems, 200) == (train, val)  # fixed, not random
    assert sum(p.answer < 1000 for p in val) > 10  # both answer lengths are held out
    with pytest.raises(ValueError, match="num_val"):
        at.split_multiplications(problems, 8100)


def test_data_schema(quick_assets):
    train = pq.read_table(quick_assets.train_file).to_pylist()
    val = pq.read_table(quick_assets.val_file).to_pylist()
    assert (len(train), len(val)) == (8100 - QUICK.num_val, QUICK.num_val)
    for split, rows in (("train", train), ("val", val)):
        for i, row in enumerate(rows):
            assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert (row["data_source"], row["ability"]) == ("hflow/multiply", "arithmetic")
            (message,) = row["prompt"]
            info = row["extra_info"]
            assert info == {"split": split, "index": i, "a": info["a"], "b": info["b"]}
            problem = at.Multiplication(info["a"], info["b"])
            assert message == {"role": "user", "content": problem.question}
            assert row["reward_model"] == {"style": "rule", "ground_truth": str(info["a"] * info["b"])}
    questions = {split: {r["prompt"][0]["content"] for r in rows} for split, rows in (("train", train), ("val", val))}
    assert not questions["train"] & questions["val"] and len(questions["train"] | questions["val"]) == 8100
    # The scorer reads 4-digit answers, the final answer turn's number; a call turn is not an answer.
    assert compute_score("3182", "3182") == 1.0 and compute_score("1,024", "1024") == 1.0
    assert compute_score("3183", "3182") == 0.0 and compute_score("318", "3182") == 0.0
    assert compute_score(at.call_text("37 * 86"), "3182") == 0.0
    tools = yaml.safe_load(Path(quick_assets.tool_config_file).read_text())
    assert tools == {"tools": [{"class_name": "calculator", "config": {}}]}


# ------------------------------------------------------------------------------ tokenizer and episodes


def test_tokenizer(tokenizer, tmp_path):
    for digit in "0123456789":
        assert len(_ids(tokenizer, digit)) == 1
    assert len(_ids(tokenizer, "3182")) == 4
    call = at.call_text("37 * 86")
    assert call == '<tool_call>{"name": "calculator", "arguments": {"expression": "37 * 86"}}</tool_call>'
    ids = _ids(tokenizer, call)
    assert tokenizer.decode(ids) == call and len(ids) <= 22, [tokenizer.decode([i]) for i in ids]
    # 13 tokens of JSON skeleton (the pre-tokenizer's minimum), the digits one each
    skeleton = _ids(tokenizer, call.split("37")[0])
    assert len(skeleton) == 14 and skeleton == ids[:14]
    # the call markers are single, normal tokens: kept when special tokens are skipped
    for marker in (at.TOOL_CALL_START, at.TOOL_CALL_END):
        (token,) = _ids(tokenizer, marker)
        assert token not in tokenizer.all_special_ids
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == call
    # the defaults of build_tokenizer are still the built-in tokenizer: no markers, 512 tokens
    default = build_tokenizer(tmp_path)
    assert len(default) == 512 and len(default.encode(at.TOOL_CALL_START, add_special_tokens=False)) > 1


def test_episode_layout(tokenizer):
    eos = tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": P.question}], add_generation_prompt=True,
                                           tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    call = _ids(tokenizer, at.call_text(P.expression)) + [eos]
    tool = ToolMessageEncoder(tokenizer).encode([{"role": "tool", "content": "3182"}])
    answer = _ids(tokenizer, "3182") + [eos]
    ids, mask = at.episode_ids(tokenizer, P, tool=True)
    assert ids == prompt + call + tool + answer
    assert mask == [0] * len(prompt) + [1] * len(call) + [0] * len(tool) + [1] * len(answer)
    assert tokenizer.decode(ids) == (
        "<|im_start|>user\nWhat is 37 * 86?<|im_end|>\n<|im_start|>assistant\n" + at.call_text("37 * 86")
        + "<|im_end|>\n<|im_start|>tool\n3182<|im_end|>\n<|im_start|>assistant\n3182<|im_end|>"
    )
    assert len(ids) <= 66
    guess, guess_mask = at.episode_ids(tokenizer, P, tool=False)
    assert guess == prompt + _ids(tokenizer, "2400") + [eos]
    assert guess_mask == [0] * len(prompt) + [1] * 5

    # Pre-training trains on exactly these ids: the weights sit on the assistant tokens, the first one's
    # weight is the episode's share of the first token, the tool episode's answer turn (digits and EOS)
    # has the answer weight.
    problems = [P, at.Multiplication(10, 11)]  # 4- and 3-digit answers
    for tool_episode, first in ((True, 0.75), (False, 2.25)):
        x, w = at._corpus(tokenizer, problems, tool=tool_episode, first_weight=first, answer_weight=2.5)
        for row, problem in enumerate(problems):
            ids, mask = at.episode_ids(tokenizer, problem, tool=tool_episode)
            assert x[row, : len(ids)].tolist() == ids and set(x[row, len(ids):].tolist()) <= {tokenizer.pad_token_id}
            expected = torch.tensor(mask[1:], dtype=torch.float)
            if tool_episode:
                expected[len(ids) - 1 - len(str(problem.answer)) - 1 :] = 2.5
            expected[len(prompt) - 1] = first
            assert w[row, : len(ids) - 1].tolist() == expected.tolist() and not w[row, len(ids) - 1:].any()


def test_model_and_info_file(quick_assets, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(quick_assets.model_path, dtype=torch.float32)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads in VLLM_CPU_HEAD_SIZES
    assert cfg.vocab_size == len(tokenizer) and cfg.eos_token_id == tokenizer.eos_token_id
    info = json.loads(Path(quick_assets.info_file).read_text())
    assert info["version"] == at.VERSION and info["spec"] == dataclasses.asdict(QUICK)
    assert (info["num_train"], info["num_val"], info["data_source"]) == (8100 - QUICK.num_val, QUICK.num_val,
                                                                        "hflow/multiply")
    assert set(info["base_model"]) >= {"tool_call_prob_t1", "tool_call_rate_t1", "expression_copy_rate",
                                       "answer_copy_rate", "greedy_acc_no_tools", "greedy_acc_with_tools"}
    root = Path(quick_assets.root)
    assert info["sha256"] == {k: v for k, v in _hashes(quick_assets.root).items()
                              if k not in (at.INFO_NAME, assets.MARKER_NAME)}
    assert {"model/model.safetensors", "data/train.parquet", "tools.yaml"} <= set(info["sha256"])
    assert (root / assets.MARKER_NAME).read_text() == at._marker_text(QUICK)


def test_default_spec_is_valid():
    spec = at.DEFAULT_AGENT_SPEC
    assert spec.model.hidden_size // spec.model.num_heads in VLLM_CPU_HEAD_SIZES
    assert spec.model.hidden_size % spec.model.num_heads == 0 and spec.model.num_heads % spec.model.num_kv_heads == 0
    assert at.AgentSpec.from_dict(json.loads(json.dumps(dataclasses.asdict(QUICK)))) == QUICK
    assert 0.0 < spec.p_tool < 0.5
    assert at._folder_name(spec) == f"agent-v{at.VERSION}"
    assert at._folder_name(QUICK).startswith(f"agent-v{at.VERSION}-")
    # another task's marker in the folder does not count
    assert at._marker_text(spec) != bt._marker_text(bt.DEFAULT_SPEC)


# ------------------------------------------------------------------------------ the cache


def test_generation_is_deterministic(quick_assets, tmp_path):
    other = at.ensure_agent_assets(tmp_path, spec=QUICK)
    assert other.root != quick_assets.root
    a, b = _hashes(quick_assets.root), _hashes(other.root)
    assert a == b, {k for k in a if a[k] != b.get(k)}


def test_cache_reuse_marker_and_failed_build(quick_assets, tmp_path, monkeypatch):
    before = _mtimes(quick_assets.root)
    monkeypatch.setattr(at, "build_agent_assets", lambda *a, **k: pytest.fail("a complete cache was rebuilt"))
    assert at.ensure_agent_assets(Path(quick_assets.root).parent, spec=QUICK) == quick_assets
    assert _mtimes(quick_assets.root) == before
    monkeypatch.undo()

    # No marker (a build that died before its last write): rebuilt, to the same bytes.
    (tmp_path / "ok").mkdir()
    copy = Path(at.ensure_agent_assets(tmp_path / "ok", spec=QUICK).root)
    (copy / assets.MARKER_NAME).unlink()
    (copy / "model" / "model.safetensors").write_bytes(b"half-written")
    assert at.ensure_agent_assets(tmp_path / "ok", spec=QUICK).root == str(copy)
    assert _hashes(str(copy)) == _hashes(quick_assets.root)
    assert [p.name for p in (tmp_path / "ok").iterdir() if not p.name.endswith(".lock")] == [copy.name]

    # A build that fails leaves nothing behind.
    def boom(*args, **kwargs):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(at, "_base_model_report", boom)
    with pytest.raises(RuntimeError, match="killed mid-build"):
        at.ensure_agent_assets(tmp_path / "failed", spec=QUICK)
    assert [p.name for p in (tmp_path / "failed").iterdir() if not p.name.endswith(".lock")] == []


def test_concurrent_first_calls_build_once(tmp_path, monkeypatch):
    builds, results = [], []
    real_build = at.build_agent_assets
    monkeypatch.setattr(at, "build_agent_assets", lambda out, spec: builds.append(out) or real_build(out, spec))
    threads = [threading.Thread(target=lambda: results.append(at.ensure_agent_assets(tmp_path, spec=QUICK)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1 and len(builds) == 1
    assert at._is_complete(Path(results[0].root), QUICK)


def test_fresh_process_build_and_command_line(quick_assets, tmp_path, monkeypatch):
    # Where torch cannot be pinned to one thread in this process, the model trains in a fresh one: same bytes.
    monkeypatch.setattr(assets, "can_pin_one_thread", lambda: False)
    other = at.ensure_agent_assets(tmp_path, spec=QUICK)
    assert _hashes(other.root) == _hashes(quick_assets.root)
    out = subprocess.run(
        [sys.executable, "-m", "hflow.tasks.agent_task", "--quick", "--cache-dir", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert json.loads(out)["assets"] == dataclasses.asdict(other)


# ------------------------------------------------------------------------------ the default model


def test_default_assets_meet_the_targets():
    """The default pre-trained model is what GRPO needs (built into the cache if missing: ~1.5 min)."""
    default = at.ensure_agent_assets()
    base = json.loads(Path(default.info_file).read_text())["base_model"]
    # It calls the tool 20-35% of the time at T=1: its mean first-token probability of <tool_call>. The rate
    # sampled on the n problems is a sum of n Bernoulli draws around it (std <= sqrt(p (1 - p) / n), 0.031 at
    # p = 0.25, n = 200): it must agree with the probability within 3 std (the sampling path calls as often
    # as the probability says), not sit in the target range itself, which a model at p = 0.25 misses 5% of
    # the time.
    p, n = base["tool_call_prob_t1"], base["num_problems"]
    assert 0.2 <= p <= 0.35, base
    assert abs(base["tool_call_rate_t1"] - p) <= 3 * math.sqrt(p * (1 - p) / n), base
    assert base["expression_copy_rate"] >= 0.95 and base["call_exact_rate"] >= 0.95, base
    assert base["answer_copy_rate"] >= 0.95, base
    assert base["greedy_acc_no_tools"] <= 0.02, base  # the model cannot multiply
    assert base["greedy_acc_with_tools"] <= 0.3 and base["greedy_tool_call_rate"] <= 0.3, base
    assert base["sampled_acc_with_tools_t1"] >= 0.15, base  # what GRPO starts from
