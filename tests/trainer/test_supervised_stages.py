"""Stages 1 and 2 of the RLHF pipeline: `main_sft` and `main_rm`.

* the datasets: which tokens SFT trains, how preference rows become groups, and bad data stopping the run
  (naming file and column) before any worker starts;
* the losses against their definitions: SFT's first-step loss is the global token mean of the NLL of the
  assistant tokens, computed here by hand, whatever the micro-batch size and number of ranks; the reward
  model's loss is -log sigmoid(r_chosen - r_rejected) (softmax cross-entropy for K responses);
* with no data or model given, both train on the built-in task: SFT's val/loss falls, the reward model's
  val/accuracy rises and its folder loads as a sequence classifier that ranks unseen style pairs (the
  number pairs, right against wrong number, stay near chance for the built-in model).
"""

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hflow import CONFIG_DIR
from hflow.trainer.config import RMTrainerConfig, SFTTrainerConfig, default_config
from hflow.trainer.supervised_trainer import run_stage
from hflow.tasks.builtin_task import ensure_builtin_assets
from hflow.utils.dataset.supervised import PreferenceDataset, SFTDataset, preference_collate_fn, sft_collate_fn
from hflow.utils.errors import DataError
from hflow.tasks.rlhf_task import ensure_rlhf_task_data
from hflow.workers.common import load_tokenizer
from hflow.workers.supervised_workers import preference_stats


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_builtin_assets().model_path)


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def sft_data_config(**overrides):
    return OmegaConf.merge(default_config(SFTTrainerConfig).data, overrides)


def rm_data_config(**overrides):
    return OmegaConf.merge(default_config(RMTrainerConfig).data, overrides)


# ----------------------------------------------------------------------------------------- datasets


def test_sft_trains_exactly_the_assistant_tokens_through_end_of_turn(tokenizer, tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 + 4?"},
            {"role": "assistant", "content": "8"}]
    file = write(tmp_path / "chat.parquet", [{"messages": chat}])
    ids, mask = SFTDataset(file, tokenizer, sft_data_config())[0].values()
    trained = [t for t, m in zip(ids, mask) if m]
    eos = tokenizer.eos_token_id
    assert trained == tokenizer.encode("5", add_special_tokens=False) + [eos] + \
        tokenizer.encode("8", add_special_tokens=False) + [eos]
    # the sequence is the whole conversation as the template renders it, up to the last end-of-turn
    full = tokenizer.apply_chat_template(chat, tokenize=True)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    assert ids == full[: len(ids)] and ids[-1] == eos


def test_sft_prompt_response_columns_equal_the_chat_form(tokenizer, tmp_path):
    plain = write(tmp_path / "plain.parquet", [{"prompt": "What is 1 + 1?", "response": "2"}])
    chat = write(tmp_path / "chat.parquet", [{"messages": [{"role": "user", "content": "What is 1 + 1?"},
                                                           {"role": "assistant", "content": "2"}]}])
    assert SFTDataset(plain, tokenizer, sft_data_config())[0] == SFTDataset(chat, tokenizer, sft_data_config())[0]


def test_sft_bad_data_names_the_file_and_column(tokenizer, tmp_path):
    wrong = write(tmp_path / "wrong.parquet", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"wrong\.parquet has no column 'prompt', 'response'"):
        SFTDataset(wrong, tokenizer, sft_data_config())
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"messages": pa.array([], pa.list_(pa.struct([("role", pa.string()),
                                                                          ("content", pa.string())])))}), empty)
    with pytest.raises(DataError, match=r"empty\.parquet has no rows"):
        SFTDataset(str(empty), tokenizer, sft_data_config())
    no_reply = write(tmp_path / "no_reply.parquet", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"no_reply\.parquet row 0: no assistant turn"):
        SFTDataset(no_reply, tokenizer, sft_data_config())
    long = write(tmp_path / "long.parquet", [{"prompt": "x " * 200, "response": "y"}])
    with pytest.raises(DataError, match=r"long\.parquet row 0 is \d+ tokens long, more than data.max_length=64"):
        SFTDataset(long, tokenizer, sft_data_config(max_length=64))


def test_preference_rows_become_groups_with_the_preferred_row_marked(tokenizer, tmp_path):
    pairs = write(tmp_path / "pairs.parquet", [{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}])
    kway = write(tmp_path / "kway.parquet", [{"prompt": "What is 1 + 1?", "responses": ["3", "4", "2"], "label": 2}])
    pair_set, kway_set = PreferenceDataset(pairs, tokenizer, rm_data_config()), PreferenceDataset(
        kway, tokenizer, rm_data_config())
    assert (pair_set.group_size, kway_set.group_size) == (2, 3)
    assert pair_set[0]["sequences"][0] == kway_set[0]["sequences"][2]  # "2" encoded the same way in both
    assert pair_set[0]["sequences"][0][-1] == tokenizer.eos_token_id  # scored at the end-of-turn token, as in PPO


def test_preference_bad_data_stops_naming_file_and_column(tokenizer, tmp_path):
    same = write(tmp_path / "same.parquet", [{"prompt": "p", "chosen": "a", "rejected": "a"}] * 3)
    with pytest.raises(DataError, match=r"same\.parquet every row's responses are identical \('chosen/rejected'"):
        PreferenceDataset(same, tokenizer, rm_data_config())
    missing = write(tmp_path / "missing.parquet", [{"prompt": "p", "chosen": "a"}])
    with pytest.raises(DataError, match=r"missing\.parquet has no column 'rejected'"):
        PreferenceDataset(missing, tokenizer, rm_data_config())
    bad_label = write(tmp_path / "bad_label.parquet", [{"prompt": "p", "responses": ["a", "b"], "label": 5}])
    with pytest.raises(DataError, match=r"bad_label\.parquet row 0 column 'label'"):
        PreferenceDataset(bad_label, tokenizer, rm_data_config())
    some_ties = write(tmp_path / "ties.parquet", [{"prompt": "p", "chosen": "a", "rejected": "a"},
                                                  {"prompt": "p", "chosen": "a", "rejected": "b"}])
    assert len(PreferenceDataset(some_ties, tokenizer, rm_data_config())) == 1  # the tie is dropped, counted


def test_bad_data_stops_the_stage_before_any_worker_starts(tmp_path, monkeypatch):
    import ray

    from hflow.trainer import main_ppo

    def no_backend(_config):
        raise AssertionError("the backend started before the data was checked")

    monkeypatch.setattr(main_ppo, "start_backend", no_backend)
    bad = write(tmp_path / "pairs.parquet", [{"prompt": "p", "chosen": "same", "rejected": "same"}])
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="rm_trainer", overrides=[f"data.train_files={bad}", f"data.val_files={bad}"])
    was_running = ray.is_initialized()
    with pytest.raises(DataError, match="pairs.parquet"):
        run_stage(config, "rm")
    assert ray.is_initialized() == was_running  # nothing was started


def test_preference_loss_is_the_ranking_loss():
    scores = torch.tensor([[2.0, -1.0], [0.5, 1.5]])
    preferred = torch.tensor([0, 0])
    stats = preference_stats(scores, preferred)
    assert torch.allclose(stats["loss"], -F.logsigmoid(scores[:, 0] - scores[:, 1]))
    assert stats["correct"].tolist() == [1.0, 0.0]
    assert torch.allclose(stats["margin"], scores[:, 0] - scores[:, 1])
    kway = torch.tensor([[0.1, 0.7, 0.2]])
    stats = preference_stats(kway, torch.tensor([1]))
    assert torch.allclose(stats["loss"], -torch.log_softmax(kway, -1)[:, 1])
    assert stats["margin"].item() == pytest.approx(0.7 - 0.15)


# ----------------------------------------------------------------------------------------- runs


def first_step_loss_by_hand(model_path, files, batch_size, seed):
    """The global batch's loss at step 1: sum of the NLL of every trained token / number of trained tokens,
    with the batch the trainer's seeded loader draws first."""
    from transformers import AutoModelForCausalLM

    from hflow.utils.dataset import create_train_dataloader

    tokenizer = load_tokenizer(model_path)
    data_cfg = sft_data_config(train_batch_size=batch_size, seed=seed, max_length=64)
    dataset = SFTDataset(files, tokenizer, data_cfg)
    batch = next(iter(create_train_dataloader(dataset, data_cfg, sft_collate_fn(tokenizer.pad_token_id))))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, :-1]
    nll = F.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
    mask = batch["loss_mask"][:, 1:].float()
    return float((nll * mask).sum() / mask.sum())


def metrics_of(log_dir):
    return [json.loads(line) for line in open(log_dir / "metrics.jsonl")]


@pytest.mark.slow  # a learning run on two Ray workers
def test_sft_on_the_builtin_task(ray_session, tmp_path):
    """Two Ray workers, micro-batches of 3: the first loss is the hand-computed global token mean; val/loss
    falls; the exported folder is a causal LM that transformers loads."""
    from transformers import AutoModelForCausalLM

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="sft_trainer", overrides=[
            "trainer.total_training_steps=14", "data.micro_batch_size_per_gpu=3", "trainer.test_freq=7",
            f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs"])
    run_stage(config, "sft", frozenset({"trainer.total_training_steps", "data.micro_batch_size_per_gpu",
                                        "trainer.test_freq"}))
    records = metrics_of(tmp_path / "logs")
    files = ensure_rlhf_task_data()
    expected = first_step_loss_by_hand(ensure_builtin_assets().model_path, files.sft_train, 32, seed=1)
    assert records[1]["train/loss"] == pytest.approx(expected, rel=1e-4)
    val = [r["val/loss"] for r in records if "val/loss" in r]
    assert len(val) == 3 and val[-1] < 0.5 * val[0], val
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "huggingface")
    assert model.config.architectures == ["Qwen2ForCausalLM"]


def test_sft_resumes_where_it_stopped(tmp_path):
    """Local backend: a run checkpointed at step 2 and restarted with 4 steps continues at step 3, with
    the loader position, optimizer and scheduler of step 2 (its step-3 loss equals an uninterrupted run's)."""
    def run(steps, out):
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            config = compose(config_name="sft_trainer", overrides=[
                "trainer.backend=local", "trainer.n_gpus_per_node=1", f"trainer.total_training_steps={steps}",
                "trainer.save_freq=2", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
                "checkpoint.contents=[model,optimizer,extra]",
                f"trainer.default_local_dir={out}/ckpt", f"trainer.log_dir={out}/logs"])
        run_stage(config, "sft", frozenset({"trainer.total_training_steps"}))
        return [(r["training/global_step"], r["train/loss"]) for r in metrics_of(out / "logs") if "train/loss" in r]

    straight = dict(run(4, tmp_path / "straight"))
    first = run(2, tmp_path / "resumed")
    # Only the second process's records: a restart from step 1 would log the same losses (the run is
    # deterministic), so the step numbers it logged are what show that it resumed.
    resumed = run(4, tmp_path / "resumed")[len(first):]
    assert [step for step, _ in resumed] == [3, 4]
    assert (tmp_path / "resumed" / "ckpt" / "global_step_4").is_dir()
    assert [loss for _, loss in resumed] == pytest.approx([straight[3], straight[4]], rel=1e-5)


@pytest.mark.slow  # a learning run on Ray
def test_reward_model_on_the_builtin_task(ray_session, tmp_path):
    """The built-in default: val/accuracy rises; the folder is a sequence classifier that, read at the last
    token as PPO's reward worker reads it, ranks the held-out style pairs (>= 0.95). The held-out number
    pairs are not asserted: the 0.46M-parameter model stays near chance on them (examples/rlhf_pipeline)."""
    from transformers import AutoModelForSequenceClassification

    from hflow.workers.supervised_workers import last_token_scores

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="rm_trainer", overrides=[
            f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs"])
    val_metrics = run_stage(config, "rm")
    records = metrics_of(tmp_path / "logs")
    assert val_metrics["val/accuracy"] >= records[0]["val/accuracy"] + 0.1, val_metrics  # it learned here
    assert all(math.isfinite(r["train/loss"]) for r in records[1:])

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "ckpt" / "huggingface").eval()
    assert model.config.architectures == ["Qwen2ForSequenceClassification"] and model.config.num_labels == 1
    tokenizer = load_tokenizer(str(tmp_path / "ckpt" / "huggingface"))
    pairs = PreferenceDataset(ensure_rlhf_task_data().rm_val, tokenizer, rm_data_config(max_length=64))
    kinds = pq.read_table(ensure_rlhf_task_data().rm_val).column("kind").to_pylist()
    batch = preference_collate_fn(tokenizer.pad_token_id)([pairs[i] for i in range(len(pairs))])
    captured = {}
    model.score.register_forward_hook(lambda _m, _i, out: captured.setdefault("out", out))
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    scores = last_token_scores(captured["out"], batch["attention_mask"]).view(-1, 2)
    correct = preference_stats(scores, batch["preferred_mask"].view(-1, 2).argmax(-1))["correct"]
    assert correct.mean().item() == pytest.approx(val_metrics["val/accuracy"], abs=1e-6)  # the model that was validated
    style = [ok for ok, kind in zip(correct.tolist(), kinds, strict=True) if kind == "style"]
    assert len(style) == 120 and sum(style) / len(style) >= 0.95
