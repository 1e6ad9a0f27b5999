"""DPO, the stage beside SFT and the reward model (`main_dpo`).

* the data: chosen/rejected as text or as messages (with or without a prompt column) encode the same
  sequences, with the loss mask on exactly the reply's tokens; bad files stop before any worker starts,
  naming file, column and rows (identical pairs counted and named, never trained on);
* the loss and its metrics against their definitions, by hand: `dpo_loss` on numbers (sigmoid, cDPO's
  label smoothing, IPO), and a real run's validation metrics recomputed from the two model folders with
  plain transformers (the policy the run wrote, the reference it started from) to 1e-6;
* learning on the built-in pairs (held-out pair accuracy and the exact-correct rate of greedy answers
  rise) with its control, the same run on the pairs with their labels shuffled (neither rises);
* the output folder loads in main_ppo as the actor and the reference (their KL starts at 0).
"""

import json
import math
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hflow import CONFIG_DIR
from hflow.tasks.builtin_task import ensure_builtin_assets
from hflow.tasks.rlhf_task import ensure_rlhf_task_data, write_shuffled_labels
from hflow.single_controller.base import Dispatch, register
from hflow.trainer.config import DPOTrainerConfig, default_config
from hflow.trainer.supervised_trainer import DPOTrainer, run_stage
from hflow.utils.dataset.supervised import DPODataset, pair_collate_fn
from hflow.utils.errors import DataError
from hflow.workers.common import load_tokenizer
from hflow.workers.supervised_workers import DPOWorker, dpo_loss
from tests.conftest import REPO_ROOT


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_builtin_assets().model_path)


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def data_config(**overrides):
    return OmegaConf.merge(default_config(DPOTrainerConfig).data, overrides)


def prompt_ids(tokenizer, chat):
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def reply_ids(tokenizer, text):
    """A reply as the policy samples it: its tokens, then the end-of-turn token."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


# ----------------------------------------------------------------------------------------- data

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def test_text_and_message_pairs_encode_the_same_with_the_mask_on_the_reply(tokenizer, tmp_path):
    text = write(tmp_path / "text.parquet", [{"prompt": QUESTION, "chosen": "5", "rejected": "6"}])
    explicit = write(tmp_path / "explicit.parquet", [{"prompt": QUESTION, "chosen": [{"role": "assistant", "content": "5"}],
                                                      "rejected": [{"role": "assistant", "content": "6"}]}])
    implicit = write(tmp_path / "implicit.parquet", [{"chosen": QUESTION + [{"role": "assistant", "content": "5"}],
                                                      "rejected": QUESTION + [{"role": "assistant", "content": "6"}]}])
    repeated = write(tmp_path / "repeated.parquet", [{"prompt": "What is 2 + 3?",  # UltraFeedback's layout
                                                      "chosen": QUESTION + [{"role": "assistant", "content": "5"}],
                                                      "rejected": QUESTION + [{"role": "assistant", "content": "6"}]}])
    pairs = [DPODataset(f, tokenizer, data_config())[0]["pair"] for f in (text, explicit, implicit, repeated)]
    assert pairs[0] == pairs[1] == pairs[2] == pairs[3]
    prompt = prompt_ids(tokenizer, QUESTION)
    for (ids, mask), reply in zip(pairs[0], ("5", "6")):
        assert ids == prompt + reply_ids(tokenizer, reply)
        assert mask == [0] * len(prompt) + [1] * len(reply_ids(tokenizer, reply))
    batch = pair_collate_fn(tokenizer.pad_token_id)([{"pair": pairs[0]}])
    assert batch["input_ids"][0].tolist()[: len(pairs[0][0][0])] == pairs[0][0][0]  # chosen first
    assert batch["loss_mask"].sum(-1).tolist() == [len(reply_ids(tokenizer, "5")), len(reply_ids(tokenizer, "6"))]


def test_bad_pairs_stop_naming_file_column_and_rows(tokenizer, tmp_path):
    no_rejected = write(tmp_path / "no_rejected.parquet", [{"prompt": "p", "chosen": "a", "answer": "b"}])
    with pytest.raises(DataError, match=r"no_rejected\.parquet has no column 'rejected'.*data\.rejected_key"):
        DPODataset(no_rejected, tokenizer, data_config())
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3 + [{"prompt": "p", "chosen": "a", "rejected": "a"}] * 2
    same = write(tmp_path / "same.parquet", rows)
    with pytest.raises(DataError, match=r"same\.parquet has 2 of 5 rows whose 'chosen' and 'rejected' replies are "
                                        r"identical \(rows 3, 4\)"):
        DPODataset(same, tokenizer, data_config())
    other_prompt = write(tmp_path / "other.parquet", [{
        "chosen": QUESTION + [{"role": "assistant", "content": "5"}],
        "rejected": [{"role": "user", "content": "What is 2 + 4?"}, {"role": "assistant", "content": "6"}]}])
    with pytest.raises(DataError, match=r"other\.parquet row 0: the conversation before the reply differs"):
        DPODataset(other_prompt, tokenizer, data_config())
    no_prompt = write(tmp_path / "no_prompt.parquet", [{"chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match=r"no_prompt\.parquet row 0 column 'chosen': a text reply needs the prompt"):
        DPODataset(no_prompt, tokenizer, data_config())


def test_bad_pairs_stop_the_stage_before_any_worker_starts(tmp_path, monkeypatch):
    from hflow.trainer import main_ppo

    def no_backend(_config):
        raise AssertionError("the backend started before the data was checked")

    monkeypatch.setattr(main_ppo, "start_backend", no_backend)
    good = ensure_rlhf_task_data().rm_val
    bad = write(tmp_path / "pairs.parquet", [{"prompt": "p", "chosen": "same", "rejected": "same"}])
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="dpo_trainer", overrides=[f"data.train_files={bad}", f"data.val_files={good}"])
    with pytest.raises(DataError, match=r"pairs\.parquet has 1 of 1 rows .* identical \(rows 0\)"):
        run_stage(config, "dpo")


# ----------------------------------------------------------------------------------------- the loss


def test_dpo_loss_is_its_definition():
    policy = torch.tensor([[-3.0, -5.0], [-4.0, -2.5]], dtype=torch.float64)
    ref = torch.tensor([[-3.5, -4.0], [-4.2, -3.0]], dtype=torch.float64)
    beta, eps = 0.2, 0.1
    h = [(-3.0 + 3.5) - (-5.0 + 4.0), (-4.0 + 4.2) - (-2.5 + 3.0)]  # 1.5, -0.3

    def log_sigmoid(x):
        return -math.log1p(math.exp(-x))

    losses, stats = dpo_loss(policy, ref, beta, "sigmoid", eps)
    assert losses.tolist() == pytest.approx(
        [-(1 - eps) * log_sigmoid(beta * x) - eps * log_sigmoid(-beta * x) for x in h], abs=1e-12)
    assert dpo_loss(policy, ref, beta)[0].tolist() == pytest.approx([-log_sigmoid(beta * x) for x in h], abs=1e-12)
    assert dpo_loss(policy, ref, beta, "ipo")[0].tolist() == pytest.approx([(x - 1 / (2 * beta)) ** 2 for x in h],
                                                                            abs=1e-12)
    assert stats["rewards/chosen"].tolist() == pytest.approx([beta * 0.5, beta * 0.2])
    assert stats["rewards/rejected"].tolist() == pytest.approx([beta * -1.0, beta * 0.5])
    assert stats["rewards/margins"].tolist() == pytest.approx([beta * x for x in h])
    assert stats["rewards/accuracies"].tolist() == [1.0, 0.0]
    assert stats["logps/chosen"].tolist() == [-3.0, -4.0] and stats["logps/rejected"].tolist() == [-5.0, -2.5]


def reply_logp(model, tokenizer, chat, text):
    """log pi(reply | prompt) by hand: the reply's tokens one by one after the prompt, no padding."""
    prompt, reply = prompt_ids(tokenizer, chat), reply_ids(tokenizer, text)
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return sum(logp[len(prompt) + i - 1, token].item() for i, token in enumerate(reply))


def metrics_of(log_dir):
    return [json.loads(line) for line in open(log_dir / "metrics.jsonl")]


def test_validation_metrics_are_the_hand_computed_loss_of_both_models(tmp_path):
    """Three steps with cDPO's smoothing, then the run's val metrics against the same quantities computed
    here from the folders: the reference (the built-in model the run started from) and the policy it wrote.
    (Each reply's log-probability is a sum of about eight fp32 terms near -9: the run's and this one agree
    to about 1e-6 of it; beta = 0.1 keeps the rewards' and losses' share of that below 1e-6.)"""
    from transformers import AutoModelForCausalLM

    beta, eps = 0.1, 0.1
    rows = pq.read_table(ensure_rlhf_task_data().rm_val).to_pylist()[:12:2]
    as_messages = [{**row, "chosen": [{"role": "assistant", "content": row["chosen"]}],
                    "rejected": [{"role": "assistant", "content": row["rejected"]}]} for row in rows[3:]]
    val = f"[{write(tmp_path / 'text.parquet', rows[:3])},{write(tmp_path / 'messages.parquet', as_messages)}]"
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="dpo_trainer", overrides=[
            "trainer.backend=local", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=3",
            "data.train_batch_size=8",
            f"data.val_files={val}", f"dpo.beta={beta}", f"dpo.label_smoothing={eps}", "optim.lr=1e-2",
            "optim.lr_warmup_steps=0",
            "trainer.val_before_train=false", "trainer.logger=[jsonl]", "data.micro_batch_size_per_gpu=3",
            f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs"])
    val_metrics = run_stage(config, "dpo", frozenset({"data.val_files"}))

    tokenizer = load_tokenizer(ensure_builtin_assets().model_path)
    ref = AutoModelForCausalLM.from_pretrained(ensure_builtin_assets().model_path, dtype=torch.float32).eval()
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "huggingface", dtype=torch.float32).eval()
    texts = [[r["chosen"], r["rejected"]] for r in rows]
    logps = {name: [[reply_logp(model, tokenizer, r["prompt"], t) for t in pair] for r, pair in zip(rows, texts)]
             for name, model in (("policy", policy), ("ref", ref))}
    by_hand = {"logps/chosen": [], "logps/rejected": [], "rewards/chosen": [], "rewards/rejected": [],
               "rewards/margins": [], "rewards/accuracies": [], "loss": []}
    for (pc, pr), (rc, rr) in zip(logps["policy"], logps["ref"]):
        h = (pc - rc) - (pr - rr)
        by_hand["logps/chosen"].append(pc)
        by_hand["logps/rejected"].append(pr)
        by_hand["rewards/chosen"].append(beta * (pc - rc))
        by_hand["rewards/rejected"].append(beta * (pr - rr))
        by_hand["rewards/margins"].append(beta * h)
        by_hand["rewards/accuracies"].append(float(pc - rc > pr - rr))
        by_hand["loss"].append((1 - eps) * math.log1p(math.exp(-beta * h)) + eps * math.log1p(math.exp(beta * h)))
    assert max(map(abs, by_hand["rewards/margins"])) > 0.05  # the policy moved: the signs are tested
    for name, values in by_hand.items():
        assert val_metrics[f"val/{name}"] == pytest.approx(sum(values) / len(values), rel=1e-6, abs=1e-6), name
    # step 1 starts at the reference: every reward is 0, the loss log 2 whatever the smoothing
    first = metrics_of(tmp_path / "logs")[0]
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6) and first["train/rewards/margins"] == 0.0


class DriftedDPOWorker(DPOWorker):
    """The DPO worker with its policy moved off the reference right after loading (the final norm's weight
    x 1.5, which sharpens every next-token distribution), as a resumed run's policy is: at step 1 a policy
    scored as its own reference would give every pair a zero margin and the loss log 2."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        super().init_model()
        with torch.no_grad():
            self.module.get_submodule("model.norm").weight.mul_(DRIFT)


DRIFT = 1.5


def test_the_training_loss_at_step_1_is_the_hand_computed_loss_against_the_reference(tmp_path, monkeypatch):
    """One training step of a policy that differs from its reference: the step's logged loss and margin are
    the hand-computed ones, the policy's reply log-probs against the reference's (the built-in model)."""
    from transformers import AutoModelForCausalLM

    beta, rows = 0.5, pq.read_table(ensure_rlhf_task_data().rm_val).to_pylist()[:8]
    pairs = write(tmp_path / "pairs.parquet", rows)
    monkeypatch.setattr(DPOTrainer, "worker_cls", DriftedDPOWorker)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="dpo_trainer", overrides=[
            "trainer.backend=local", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=1",
            f"data.train_files={pairs}", f"data.val_files={pairs}", f"data.train_batch_size={len(rows)}",
            "data.micro_batch_size_per_gpu=3", f"dpo.beta={beta}", "trainer.val_before_train=false",
            "trainer.logger=[jsonl]", f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs"])
    run_stage(config, "dpo", frozenset({"data.train_files", "data.val_files"}))

    model_path = ensure_builtin_assets().model_path
    tokenizer = load_tokenizer(model_path)
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        policy.model.norm.weight.mul_(DRIFT)
    losses, margins = [], []
    for row in rows:
        (pc, pr), (rc, rr) = ([reply_logp(model, tokenizer, row["prompt"], row[key]) for key in ("chosen", "rejected")]
                              for model in (policy, ref))
        h = (pc - rc) - (pr - rr)
        losses.append(math.log1p(math.exp(-beta * h)))
        margins.append(beta * h)
    loss = sum(losses) / len(losses)
    assert abs(loss - math.log(2)) > 0.02, f"the drift moved the loss to {loss:.4f} only: the test is vacuous"
    first = metrics_of(tmp_path / "logs")[0]
    assert first["step"] == 1
    assert first["train/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-5)
    assert first["train/rewards/margins"] == pytest.approx(sum(margins) / len(margins), rel=1e-5, abs=1e-5)


# ----------------------------------------------------------------------------------------- learning

STEPS = 20


def exact_correct(policy_path):
    """Greedy answers of `policy_path` to the 40 held-out questions: the share with the right number."""
    from examples.rlhf_pipeline.evaluate import evaluate_policy

    return evaluate_policy(str(policy_path), None)["exact_correct"]


def dpo_run(out, train_files=None):
    overrides = ["trainer.backend=local", "trainer.n_gpus_per_node=1", f"trainer.total_training_steps={STEPS}",
                 "trainer.val_before_train=false", "trainer.logger=[jsonl]",
                 f"trainer.default_local_dir={out}/ckpt", f"trainer.log_dir={out}/logs"]
    if train_files:  # the validation pairs stay the built-in ones, with their true labels
        overrides.append(f"data.train_files={train_files}")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="dpo_trainer", overrides=overrides)
    val_metrics = run_stage(config, "dpo", frozenset({"trainer.total_training_steps"}))
    return val_metrics, exact_correct(out / "ckpt" / "huggingface")


@pytest.fixture(scope="module")
def dpo_output(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo")
    return out, dpo_run(out)


@pytest.mark.slow  # learning runs (DPO and its control)
def test_dpo_learns_the_builtin_pairs_and_shuffled_labels_do_not(dpo_output, tmp_path):
    """The built-in model answers one too high (exact-correct 0 on the held-out questions). DPO on the
    built-in pairs ranks held-out pairs by its implicit reward (0.695 when measured) and answers most of
    them right (0.800). On the same pairs with chosen and rejected swapped in a random half, the pair
    accuracy stays at chance (0.523); its greedy answers move too (0.425 right when measured: any update
    breaks the one-too-high habit and some answers land on the right number), but far less than learning's."""
    before = exact_correct(ensure_builtin_assets().model_path)
    _, (learned, learned_correct) = dpo_output
    shuffled = write_shuffled_labels(ensure_rlhf_task_data().rm_train, tmp_path / "shuffled.parquet")
    control, control_correct = dpo_run(tmp_path, shuffled)
    assert before <= 0.05
    assert learned["val/rewards/accuracies"] >= 0.65 and learned_correct >= 0.6, (learned, learned_correct)
    assert control["val/rewards/accuracies"] <= 0.56, control
    assert learned_correct >= control_correct + 0.2, (learned_correct, control_correct)


@pytest.mark.slow  # a DPO run, then a PPO run from its output
def test_dpo_output_loads_in_ppo_as_actor_and_reference(dpo_output, tmp_path):
    out, _ = dpo_output
    policy = out / "ckpt" / "huggingface"
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", "data.train_batch_size=8",
         "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         f"actor_rollout_ref.model.path={policy}", "actor_rollout_ref.actor.use_kl_loss=true",
         "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.logger=[jsonl]"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = metrics_of(tmp_path / "logs" / "hflow" / "default")
    step = next(r for r in records if "actor/pg_loss" in r)
    # the reference is the same folder as the actor: at step 1 their KL is 0 (another model would not be)
    assert step["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
