"""Tests of the built-in default task and model (hflow.tasks.builtin_task).

They use QUICK_SPEC, a seconds-long build with the same structure as the default; the default
build (about a minute of pre-training) is exercised by the end-to-end trainer run.
"""

import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hflow.tasks import assets
from hflow.tasks import builtin_task as bt
from hflow.reward.score.arithmetic import compute_score
from hflow.tasks.tiny_models import VLLM_CPU_HEAD_SIZES
from hflow.utils.cache import default_cache_root

QUICK = bt.QUICK_SPEC


@pytest.fixture(scope="module")
def quick_assets(tmp_path_factory) -> bt.BuiltinAssets:
    return bt.ensure_builtin_assets(tmp_path_factory.mktemp("cache"), spec=QUICK)


def _hashes(folder: str) -> dict[str, str]:
    root = Path(folder)
    return {str(p.relative_to(root)): assets.sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _mtimes(folder: str) -> dict[str, int]:
    root = Path(folder)
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ the task


def test_problems_and_split():
    problems = bt.builtin_problems()
    assert len(problems) == 155 and len(set(problems)) == 155
    assert all(0 <= p.a <= 9 and 0 <= p.b <= 9 and 0 <= p.answer <= 18 for p in problems)
    assert bt.Problem(7, "+", 5).question == "What is 7 + 5?" and bt.Problem(9, "-", 4).answer == 5
    train, val = bt.split_problems(problems, bt.DEFAULT_SPEC.num_val_per_op)
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(problems)
    assert sum(p.op == "+" for p in val) == sum(p.op == "-" for p in val) == bt.DEFAULT_SPEC.num_val_per_op
    assert bt.split_problems(problems, bt.DEFAULT_SPEC.num_val_per_op) == (
        train,
        val,
    )  # a fixed split, not a random one
    with pytest.raises(ValueError, match="no training problems"):
        bt.split_problems(problems, 55)


def test_data_schema(quick_assets):
    train = pq.read_table(quick_assets.train_file).to_pylist()
    val = pq.read_table(quick_assets.val_file).to_pylist()
    assert (len(train), len(val)) == (115, 40)
    for split, rows in (("train", train), ("val", val)):
        for i, row in enumerate(rows):
            assert set(row) == {
                "data_source",
                "prompt",
                "ability",
                "reward_model",
                "extra_info",
            }
            assert row["data_source"] == bt.DATA_SOURCE == "hflow/arithmetic"
            assert row["ability"] == "arithmetic"
            (message,) = row["prompt"]
            assert message["role"] == "user"
            info = row["extra_info"]
            assert info["split"] == split and info["index"] == i
            problem = bt.Problem(info["a"], info["op"], info["b"])
            assert message["content"] == problem.question
            truth = row["reward_model"]["ground_truth"]
            assert isinstance(truth, str) and int(truth) == problem.answer == info["answer"]
            assert compute_score(truth, truth) == 1.0
            assert compute_score(str(problem.answer + 1), truth) == 0.0
    train_q = {r["prompt"][0]["content"] for r in train}
    val_q = {r["prompt"][0]["content"] for r in val}
    assert not train_q & val_q, "train and val share problems"
    assert len(train_q | val_q) == 155


# ------------------------------------------------------------------------------ the model


def test_model_and_tokenizer_load(quick_assets):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(quick_assets.model_path)
    text = "What is 12 + 7?"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    for digit in "0123456789":  # every digit is one token, so numbers are spelled digit by digit
        assert len(tok.encode(digit, add_special_tokens=False)) == 1
    assert len(tok.encode("12", add_special_tokens=False)) == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    assert prompt == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None

    model = AutoModelForCausalLM.from_pretrained(quick_assets.model_path, dtype=torch.float32)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads in VLLM_CPU_HEAD_SIZES
    assert cfg.vocab_size == len(tok) and cfg.eos_token_id == tok.eos_token_id
    assert (Path(quick_assets.model_path) / "model.safetensors").is_file()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,  # the default from transformers 5 on
    )
    input_ids = enc["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    assert out.shape[1] > input_ids.shape[1]


def test_default_spec_is_valid():
    spec = bt.DEFAULT_SPEC
    assert spec.hidden_size // spec.num_heads in VLLM_CPU_HEAD_SIZES
    assert spec.hidden_size % spec.num_heads == 0 and spec.num_heads % spec.num_kv_heads == 0
    assert 0.0 < spec.p_correct < 0.5  # the sloppy answer must be the more likely one
    assert bt._folder_name(spec) == f"builtin-v{bt.VERSION}"
    assert bt._folder_name(QUICK).startswith(f"builtin-v{bt.VERSION}-")


def test_info_file(quick_assets):
    info = json.loads(Path(quick_assets.info_file).read_text())
    # a zero p_hedge or p_hint is left out, and so are the MoE fields of a dense spec (num_experts 0)
    no_hedges = {k: v for k, v in dataclasses.asdict(QUICK).items()
                 if k not in ("p_hedge", "p_hint", "num_experts", "experts_per_token", "aux_loss_coef")}
    assert info["version"] == bt.VERSION and info["spec"] == no_hedges
    assert (info["num_train"], info["num_val"]) == (115, 40)
    assert set(info["base_model"]) >= {"greedy_acc_val", "greedy_acc_train"}
    weights = Path(quick_assets.model_path) / "model.safetensors"
    assert info["sha256"]["model/model.safetensors"] == assets.sha256_file(weights)


# ------------------------------------------------------------------------------ the cache


def test_generation_is_deterministic(quick_assets, tmp_path):
    other = bt.ensure_builtin_assets(tmp_path, spec=QUICK)
    assert other.root != quick_assets.root
    a, b = _hashes(quick_assets.root), _hashes(other.root)
    assert a == b, {k for k in a if a[k] != b.get(k)}
    assert {
        "data/train.parquet",
        "data/val.parquet",
        "model/model.safetensors",
        assets.MARKER_NAME,
    } <= set(a)


def test_cache_is_reused(quick_assets, monkeypatch):
    before = _mtimes(quick_assets.root)

    def must_not_build(*args, **kwargs):
        raise AssertionError("a complete cache was rebuilt")

    monkeypatch.setattr(bt, "build_builtin_assets", must_not_build)
    again = bt.ensure_builtin_assets(Path(quick_assets.root).parent, spec=QUICK)
    assert again == quick_assets
    assert _mtimes(quick_assets.root) == before


def test_incomplete_cache_is_rebuilt(quick_assets, tmp_path):
    shutil.copytree(quick_assets.root, tmp_path / Path(quick_assets.root).name)
    first = bt.ensure_builtin_assets(tmp_path, spec=QUICK)  # the copy is complete: used as it is
    assert first.root == str(tmp_path / Path(quick_assets.root).name)
    hashes = _hashes(first.root)
    marker = Path(first.root) / assets.MARKER_NAME
    marker.unlink()  # as if the build had died before its last write
    (Path(first.root) / "model" / "model.safetensors").write_bytes(b"half-written")
    rebuilt = bt.ensure_builtin_assets(tmp_path, spec=QUICK)
    assert rebuilt == first and marker.is_file()
    assert _hashes(rebuilt.root) == hashes
    # A marker from another version or spec does not count either.
    marker.write_text(json.dumps({"version": "0", "spec_digest": QUICK.digest()}))
    assert not bt._is_complete(Path(first.root), QUICK)
    # Nothing else is left in the cache root (temporary or stale folders).
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [Path(first.root).name]


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(bt, "_base_model_report", boom)
    with pytest.raises(RuntimeError, match="killed mid-build"):
        bt.ensure_builtin_assets(tmp_path, spec=QUICK)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_concurrent_first_calls_build_once(tmp_path, monkeypatch):
    calls = []
    real_build = bt.build_builtin_assets

    def counting_build(out_dir, spec):
        calls.append(out_dir)
        return real_build(out_dir, spec)

    monkeypatch.setattr(bt, "build_builtin_assets", counting_build)
    results, errors = [], []

    def worker():
        try:
            results.append(bt.ensure_builtin_assets(tmp_path, spec=QUICK))
        except Exception as e:  # noqa: BLE001 - collected and asserted on below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 3 and len(set(results)) == 1
    assert len(calls) == 1
    assert bt._is_complete(Path(results[0].root), QUICK)


def test_cache_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path / "hf"))
    assert default_cache_root() == tmp_path / "hf"
    monkeypatch.delenv("HFLOW_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "hflow"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_root() == Path.home() / ".cache" / "hflow"
    assert os.path.basename(bt._folder_name(bt.DEFAULT_SPEC)) == "builtin-v1"


def test_fresh_process_build_matches(quick_assets, tmp_path, monkeypatch):
    # Where torch.set_num_threads is disabled (an in-process vLLM engine does that), the model is trained
    # in a fresh interpreter instead; the bytes must not depend on which path ran.
    monkeypatch.setattr(assets, "can_pin_one_thread", lambda: False)
    other = bt.ensure_builtin_assets(tmp_path, spec=QUICK)
    assert _hashes(other.root) == _hashes(quick_assets.root)
