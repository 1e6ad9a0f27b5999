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
from omegaconf import OmegaConf

from hflow.agent.parsers import ParsedTurn, ToolCall, ToolCallParser, register_parser
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
    critic's values, the advantages and both updates come back finite; the sampler's log-probs are the trainer's.
    The critic saved after the step has moved from the model it started from in its language model and in its
    vision tower, which only a gradient through the images reaches: its update saw them."""
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 3 == 0)\n")
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=gae", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=1",
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
    assert record["critic/grad_norm"] > 0, record
    assert record["training/rollout_probs_diff_max"] < 1e-3
    moved = moved_critic_weights(tmp_path / "checkpoints" / "hflow" / "default" / "global_step_1" / "critic",
                                 vl_dir, tmp_path)
    assert any("visual" in name for name in moved), sorted(moved)
    assert any("language_model" in name for name in moved), sorted(moved)


def moved_critic_weights(checkpoint: Path, start: Path, tmp_path: Path) -> set[str]:
    """The names of the backbone weights in a critic checkpoint that differ from the model in `start`."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hflow.workers.fsdp import clean_param_name

    dcp_to_torch_save(str(checkpoint / "model_optim"), str(tmp_path / "critic.pt"))
    saved = {clean_param_name(k): v for k, v in torch.load(tmp_path / "critic.pt", weights_only=True)["model"].items()}
    initial = load_value_model(str(start), attn_implementation=SDPA_VARLEN, value_head_init="normal").state_dict()
    backbone = [name for name in initial if name in saved and not name.startswith("score.")]
    assert len(backbone) > 10 and any("visual" in name for name in backbone), sorted(saved)
    return {name for name in backbone if not torch.equal(saved[name].float(), initial[name].float())}


# ---- multi-turn episodes on image prompts ------------------------------------------------------------------


@register_parser("test-always-calls")
class AlwaysCalls(ToolCallParser):
    """Every turn calls `echo` (the random model writes no tool calls): episodes run to the turn limit."""

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(content="", calls=[ToolCall("echo", {"text": text[:4]})], malformed=[])


@torch.no_grad()
def end_turns_soon(model, tokenizer, strength: float = 0.6) -> None:
    """Point the EOS logit row along the mean final hidden state (in place), so a random model ends its turns
    within a few tokens and an episode holds several."""
    ids = torch.randint(10, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    hidden = model.model(input_ids=ids).last_hidden_state.flatten(0, 1)
    mean = hidden.mean(0)
    model.lm_head.weight[tokenizer.eos_token_id] = strength * mean / mean.norm() * hidden.norm(dim=-1).mean()


def echo_tool_config(folder: Path) -> str:
    (folder / "echo_tools.py").write_text('def echo(text: str) -> str:\n    return "seen: " + text\n')
    (folder / "tools.yaml").write_text(
        "tools:\n  - function: echo_tools.py:echo\n    tool_schema:\n      type: function\n      function:\n"
        "        name: echo\n        description: repeat the text\n"
        "        parameters: {type: object, properties: {text: {type: string}}, required: [text]}\n")
    return str(folder / "tools.yaml")


@pytest.mark.parametrize("remove_padding", [True, False])
def test_multi_turn_episode_on_an_image_prompt_sampler_equals_trainer(vl_dir, tokenizer, prompts, tmp_path,
                                                                      remove_padding):
    """An image prompt, assistant turns and text tool results (HF rollout): the image's tokens stay in the
    trajectory's prompt, and the trainer's log-probs of every sampled token -- later turns included, sampled
    after tool tokens -- are the sampler's, which they are only if every turn was sampled with the images and
    the multimodal positions the trainer computes over the whole episode."""
    from hflow.workers.actor import DataParallelPPOActor
    from hflow.workers.rollout.hf_rollout import HFRollout
    from tests.workers.test_vision import make_actor

    config = default_config().actor_rollout_ref.rollout
    for key, value in {"n": 2, "temperature": 0.8, "response_length": 40, "prompt_length": 64,
                       "multi_turn.enable": True, "multi_turn.format": "test-always-calls",
                       "multi_turn.tool_config_path": echo_tool_config(tmp_path),
                       "multi_turn.max_assistant_turns": 2}.items():
        OmegaConf.update(config, key, value, merge=True)
    actor = make_actor(vl_dir, remove_padding=remove_padding)
    end_turns_soon(actor.actor_module, tokenizer)
    images = prompts.select_idxs([0, 1])  # one image; two images
    torch.manual_seed(0)
    out = HFRollout(actor.actor_module, config, tokenizer).generate_sequences(images)

    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grids = [m["image_grid_thw"] for m in out.non_tensor_batch["multi_modal_inputs"]]
    assert [int((p == image_token).sum()) for p in out.batch["prompts"]] == [int(g.prod(-1).sum()) // 4 for g in grids]
    episodes = out.non_tensor_batch["episode"]
    mask = out.batch["response_mask"].bool()
    second_turn = torch.zeros_like(mask)  # the sampled tokens after the first tool result
    for i, episode in enumerate(episodes):
        if episode["num_turns"] == 2:
            tool = (~mask[i] & out.batch["attention_mask"][i, -mask.shape[1]:].bool()).nonzero()
            second_turn[i, int(tool[-1]) + 1:] = mask[i, int(tool[-1]) + 1:]
    out.meta_info.update(temperature=0.8, micro_batch_size=3)
    log_probs, _ = actor.compute_log_prob(out)
    assert (log_probs - out.batch["rollout_log_probs"])[mask].abs().max() < 1e-4
    assert second_turn.sum() >= 4, [(e["num_turns"], e["ended"]) for e in episodes]
    # the images matter to those later turns: other pixels give other log-probs there
    other = out.select(deepcopy=True)
    other.non_tensor_batch["multi_modal_inputs"] = np.array(
        [{**m, "pixel_values": torch.randn_like(m["pixel_values"])} for m in other.non_tensor_batch["multi_modal_inputs"]],
        dtype=object)
    blind, _ = DataParallelPPOActor(actor.config, actor.actor_module).compute_log_prob(other)
    assert (blind - log_probs)[second_turn].abs().max() > 1e-3


def test_preflight_refuses_images_on_vllm_streaming_rollouts(data_file):
    """vLLM's multi-turn loop, continuous admission and interruptible generation do not take images yet:
    preflight stops such a run naming the data file and the keys; the HF rollout and single-turn vLLM pass."""
    from hflow.trainer.preflight import check_image_rollouts
    from hflow.utils.errors import ConfigError

    config = default_config()
    config.data.train_files = config.data.val_files = data_file
    config.actor_rollout_ref.rollout.name = "vllm"
    check_image_rollouts(config)  # single-turn vLLM takes them
    for key, value in (("multi_turn.enable", True), ("admission", "continuous"), ("partial_rollout", True)):
        streaming = config.copy()
        OmegaConf.update(streaming, f"actor_rollout_ref.rollout.{key}", value)
        with pytest.raises(ConfigError, match=rf"data.train_files: .* has images .*rollout.{key}=.*rollout.name=hf"):
            check_image_rollouts(streaming)
        streaming.actor_rollout_ref.rollout.name = "hf"
        check_image_rollouts(streaming)


# ---- the memory plan -----------------------------------------------------------------------------------------


def test_memory_plan_counts_the_vision_tower_on_the_images(vl_dir, tmp_path, monkeypatch):
    """A vision-language model's plan holds its vision tower's parameters and, in every pass, what the tower holds
    on the micro-batch's images (traced on fake tensors); more image tokens per prompt, more memory; a frozen
    tower holds no activations for backward; a text model has no such term."""
    from hydra import compose, initialize_config_dir

    from hflow import CONFIG_DIR
    from hflow.trainer.config import validate_config
    from hflow.trainer.memory import plan as mp
    from hflow.trainer.memory.facts import model_numel

    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path / "cache"))

    def plan(prompt: int, *overrides: str) -> dict[str, dict[str, float]]:
        args = [f"actor_rollout_ref.model.path={vl_dir}", f"data.max_prompt_length={prompt}",
                "data.max_response_length=16", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=1",
                "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", "algorithm.adv_estimator=gae",
                "critic.forward_micro_batch_size_per_gpu=2", "trainer.backend=local", "trainer.n_gpus_per_node=1",
                *overrides]
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            config = validate_config(compose(config_name="ppo_trainer", overrides=args))
        return {p.name: p.components for p in mp.plan_memory(config, "cpu", 8 * 2**30).phases}

    def tower(phases, name: str) -> float:
        [value] = [v for k, v in phases[name].items() if "vision tower" in k]
        return value

    vision_params = sum(p.numel() for n, p in make_critic(vl_dir, False).critic_module.named_parameters()
                        if "visual" in n)
    assert model_numel(json.dumps(json.loads((vl_dir / "config.json").read_text())))[0] > vision_params > 0
    small, large = plan(32), plan(128)
    for name in ("old log-prob", "values", "actor update", "critic update"):
        assert tower(large, name) > 3 * tower(small, name) > 0, name  # 4x the image tokens
    frozen = plan(32, "actor_rollout_ref.actor.freeze_vision_tower=true")
    # (at this width the processor's fp32 pixels, 4 patches x 1176 values per image token, are most of it)
    assert tower(small, "actor update") > 1.3 * tower(small, "old log-prob")  # the backward keeps the activations
    assert tower(frozen, "actor update") < 0.8 * tower(small, "actor update")
    assert tower(frozen, "critic update") < 0.8 * tower(small, "critic update")  # the critic's follows the actor's
    assert mp.image_layout(str(vl_dir), json.dumps({"model_type": "qwen2"}), 64) == ()
    assert mp.image_layout(str(vl_dir), (vl_dir / "config.json").read_text(), 40) == (16, 16, 8)  # 112x112 at most


def test_critic_freeze_vision_tower_needs_a_vision_model(vl_dir, tmp_path):
    from hflow.utils.errors import ConfigError
    from hflow.workers.critic.config import check_vision_freeze

    critic = default_config().critic
    critic.freeze_vision_tower, critic.model.path = True, str(vl_dir)
    check_vision_freeze(critic)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    critic.model.path = str(tmp_path)
    with pytest.raises(ConfigError, match="critic.freeze_vision_tower=true .* not a vision-language model"):
        check_vision_freeze(critic)
