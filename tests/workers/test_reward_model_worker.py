"""RewardModelWorker: the score is the classifier's output at the last valid token of each sequence."""

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForSequenceClassification, Qwen2Config

from hflow.trainer.config import default_config
from hflow.protocol import DataProto
from hflow.tasks.tiny_models import build_tokenizer
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers.fsdp_workers import RewardModelWorker

P, L = 12, 6


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    policy_tok = build_tokenizer(root / "policy")
    rm_dir = root / "rm"
    tokenizer = build_tokenizer(rm_dir)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(rm_dir)
    # A second copy of the reward model whose chat template differs from the policy's.
    other_dir = root / "rm_other_template"
    other_tok = build_tokenizer(other_dir)
    other_tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    other_tok.save_pretrained(other_dir)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(other_dir)
    return {"policy": root / "policy", "rm": rm_dir, "other": other_dir, "policy_tok": policy_tok}


def make_worker(model_path, input_tokenizer=None):
    config = default_config().reward_model
    config.model.path = str(model_path)
    config.model.input_tokenizer = input_tokenizer
    config.micro_batch_size_per_gpu = 2
    worker = RewardModelWorker(config)
    worker.init_model()
    return worker


def make_batch(tokenizer):
    prompts = ["What is 2 + 3?", "Name a colour.", "Say hi"]
    responses = ["It is 5.", "Blue", ""]  # the last response is empty: no score is placed
    input_ids = torch.full((3, P + L), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"][-P:]
        r = tokenizer(response, add_special_tokens=False)["input_ids"][:L]
        input_ids[i, P - len(p):P] = torch.tensor(p)
        attention_mask[i, P - len(p):P] = 1
        if r:
            input_ids[i, P:P + len(r)] = torch.tensor(r)
            attention_mask[i, P:P + len(r)] = 1
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask,
         "position_ids": compute_position_id_with_mask(attention_mask), "responses": input_ids[:, P:]},
        non_tensors={"raw_prompt": np.array([[{"role": "user", "content": p}] for p in prompts] + [], dtype=object)},
    )


def test_score_is_the_output_at_the_last_valid_token(folders, world_of_one):
    worker = make_worker(folders["rm"])
    batch = make_batch(folders["policy_tok"])
    rm_scores = worker.compute_rm_score(batch).batch["rm_scores"]
    model = AutoModelForSequenceClassification.from_pretrained(folders["rm"]).eval()
    mask = batch.batch["attention_mask"]
    for i in range(2):
        ids = batch.batch["input_ids"][i][mask[i].bool()][None]  # unpadded: the last token is the real last
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, 0]
        last = int(mask[i, P:].nonzero().max())
        torch.testing.assert_close(rm_scores[i, last], expected, rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(rm_scores[i]) == 1
    assert torch.count_nonzero(rm_scores[2]) == 0


def test_retokenizes_with_the_reward_models_own_chat_template(folders, world_of_one):
    worker = make_worker(folders["other"], input_tokenizer=str(folders["policy"]))
    assert worker._retokenize
    batch = make_batch(folders["policy_tok"])
    rm_scores = worker.compute_rm_score(batch).batch["rm_scores"]
    model = AutoModelForSequenceClassification.from_pretrained(folders["other"]).eval()
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."}]
    ids = worker.tokenizer(worker.tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False,
                           return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits[0, 0]
    torch.testing.assert_close(rm_scores[0].sum(), expected, rtol=1e-5, atol=1e-5)


def test_root_is_resharded_after_scoring(folders, world_of_one, fsdp_on_one_rank):
    """No backward follows the forward, so the worker frees the gathered root itself: afterwards every
    parameter is a shard again (a full copy would otherwise sit on the device until the next call)."""
    worker = make_worker(folders["rm"])
    worker.compute_rm_score(make_batch(folders["policy_tok"]))
    assert all(isinstance(p, DTensor) for p in worker.module.parameters())
