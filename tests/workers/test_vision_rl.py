"""Vision-language RL beyond the policy's single-turn forward (issue 36): a critic on the Qwen2-VL backbone
that sees the images (packed == padded == each sample alone, the images change the values, its update reaches
or spares the vision tower), one PPO step with a critic end to end, and images in multi-turn episodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hflow.protocol import DataProto
from hflow.tasks.tiny_vision import build_vision_lm
from hflow.trainer.config import default_config
from hflow.utils.dataset import RLHFDataset, collate_fn
from hflow.utils.packing import SDPA_VARLEN
from hflow.utils.vision import freeze_vision_tower, load_processor
from hflow.workers.common import load_tokenizer
from hflow.workers.config import resolved_copy
from hflow.workers.critic import DataParallelPPOCritic
from hflow.workers.fsdp import load_value_model
from tests.conftest import REPO_ROOT
from tests.workers.test_vision import RESPONSE_LEN, data_config, image_rows, write

ATOL = 1e-5


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_lm(tmp_path_factory.mktemp("qwen2-vl-tiny"))


@pytest.fixture(scope="module")
def tokenizer(vl_dir):
    return load_tokenizer(str(vl_dir))


@pytest.fixture(scope="module")
def processor(vl_dir, tokenizer):
    return load_processor(str(vl_dir), tokenizer)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("vision-data")
    return write(tmp / "train.parquet", image_rows(tmp))


@pytest.fixture(scope="module")
def prompts(tokenizer, processor, data_file) -> DataProto:
    dataset = RLHFDataset(data_file, tokenizer, data_config(), processor=processor)
    data = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    data.meta_info.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return data


@pytest.fixture(scope="module")
def batch(prompts) -> DataProto:
    """The prompts with random responses of different lengths (right-padded), values and returns."""
    data = prompts.select(deepcopy=True)
    n = len(data)
    gen = torch.Generator().manual_seed(0)
    response_mask = (torch.arange(RESPONSE_LEN) < torch.tensor([6, 1, 4, 6, 3])[:, None]).long()
    responses = torch.randint(1, 500, (n, RESPONSE_LEN), generator=gen) * response_mask
    attention_mask = torch.cat([data.batch["attention_mask"], response_mask], dim=-1)
    data.batch["responses"] = responses
    data.batch["input_ids"] = torch.cat([data.batch["input_ids"], responses], dim=-1)
    data.batch["attention_mask"] = attention_mask
    data.batch["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    data.batch["response_mask"] = response_mask
    data.batch["values"] = torch.zeros(n, RESPONSE_LEN)
    data.batch["returns"] = torch.randn(n, RESPONSE_LEN, generator=gen) * response_mask
    data.meta_info.update(micro_batch_size=2)
    return data


# ---- the critic -------------------------------------------------------------------------------------------


def make_critic(vl_dir: Path, remove_padding: bool, optimizer: bool = False, frozen: bool = False) -> DataParallelPPOCritic:
    # a normal-initialised head: the zero default would make every value 0, whatever the images
    model = load_value_model(str(vl_dir), attn_implementation=SDPA_VARLEN, value_head_init="normal")
    if frozen:
        freeze_vision_tower(model, "critic.freeze_vision_tower")
    config = resolved_copy(default_config().critic)
    config.use_remove_padding = remove_padding
    config.ppo_mini_batch_size_per_rank, config.ppo_micro_batch_size_per_gpu = 5, 2
    config.shuffle, config.grad_clip = False, 1e6
    trainable = [p for p in model.parameters() if p.requires_grad]
    return DataParallelPPOCritic(config, model, torch.optim.SGD(trainable, lr=0.5) if optimizer else None)


def values_alone(model, data: DataProto, i: int) -> torch.Tensor:
    """Values of sample i's response states, the model on the sample alone (no padding), with the multimodal
    positions it computes itself from its processor-style inputs."""
    valid = data.batch["attention_mask"][i].bool()
    ids = data.batch["input_ids"][i][valid][None]
    inputs = dict(data.non_tensor_batch["multi_modal_inputs"][i])
    mm_types = (ids == model.config.image_token_id).int()
    values = model(input_ids=ids, mm_token_type_ids=mm_types, **inputs, use_cache=False).logits[0, :, 0]
    length = int(data.batch["response_mask"][i].sum())
    return values[ids.shape[1] - length - 1 : ids.shape[1] - 1]


def test_critic_values_with_images_packed_padded_alone(vl_dir, batch):
    critic = make_critic(vl_dir, remove_padding=True)
    assert type(critic.critic_module).__name__ == "Qwen2VLForTokenClassification"
    padded = make_critic(vl_dir, remove_padding=False).compute_values(batch)
    packed = critic.compute_values(batch)
    dynamic = critic.compute_values(DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch,
                                              meta_info={"use_dynamic_bsz": True, "max_token_len": 90}))
    mask = batch.batch["response_mask"].bool()
    assert torch.allclose(packed, padded, atol=ATOL), (packed - padded).abs().max()
    assert torch.allclose(dynamic, padded, atol=ATOL), (dynamic - padded).abs().max()
    with torch.no_grad():
        for i in range(len(batch)):
            alone = values_alone(critic.critic_module, batch, i)
            assert torch.allclose(padded[i][mask[i]], alone, atol=ATOL), (i, (padded[i][mask[i]] - alone).abs().max())
    # the images matter: the same prompts with other pictures give other values
    other = batch.slice(0, 2)
    other.non_tensor_batch["multi_modal_inputs"] = np.array(
        [{**m, "pixel_values": torch.randn_like(m["pixel_values"])} for m in other.non_tensor_batch["multi_modal_inputs"]],
        dtype=object)
    assert (critic.compute_values(other)[0] - packed[0])[mask[0]].abs().max() > 1e-3


@pytest.mark.parametrize("frozen", [False, True])
def test_critic_update_reaches_or_spares_the_vision_tower(vl_dir, batch, frozen):
    critic = make_critic(vl_dir, remove_padding=True, optimizer=True, frozen=frozen)
    before = {n: p.detach().clone() for n, p in critic.critic_module.named_parameters()}
    metrics = critic.update_critic(batch)
    assert np.isfinite(metrics["critic/vf_loss"]).all()
    moved = {n for n, p in critic.critic_module.named_parameters() if not torch.equal(p, before[n])}
    assert "score.weight" in moved and any("language_model" in n for n in moved)
    assert any("visual" in n for n in moved) != frozen


def test_one_ppo_step_with_a_vision_critic(vl_dir, data_file, tmp_path):
    """PPO with a critic (GAE) on image prompts, end to end: HF rollout on the local backend, one step. The
    critic's values, the advantages and both updates come back finite; the sampler's log-probs are the trainer's."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 3 == 0)\n")
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=gae", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1",
         "trainer.val_before_train=false", "actor_rollout_ref.rollout.name=hf", f"data.train_files={data_file}",
         f"data.val_files={data_file}", "data.train_batch_size=4", "data.max_prompt_length=64",
         "data.max_response_length=8", f"actor_rollout_ref.model.path={vl_dir}",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.n=1", f"custom_reward_function.path={reward}",
         "actor_rollout_ref.model.use_remove_padding=true", "critic.model.value_head_init=normal"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    [record] = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")
                if '"critic/vf_loss"' in line]
    for key in ("critic/vf_loss", "critic/values/mean", "critic/advantages/max", "actor/pg_loss"):
        assert np.isfinite(record[key]), key
    assert record["critic/values/max"] > record["critic/values/min"]  # a normal head: values differ by state
    assert record["training/rollout_probs_diff_max"] < 1e-3
