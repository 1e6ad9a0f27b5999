"""`python -m hflow.cli.convert_checkpoint`: a checkpoint that two FSDP2 ranks (gloo, CPU) saved through the
actor worker's own `save_checkpoint` becomes a Hugging Face folder whose logits are the trainer's model's.

One spawn of two ranks builds two actors (a LoRA actor on a tied Qwen2, a full fine-tuned one with an EMA of
its weights on an untied Llama), takes one PPO step with each, records rank 0's logits of the live (and EMA) weights and
saves a checkpoint; the tests convert those offline in this process.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from hflow.tasks.tiny_models import build_causal_lm
from hflow.cli.convert_checkpoint import CheckpointError, convert_checkpoint, main, verify_conversion
from tests.ranks import free_port, spawn_ranks

WORLD = 2
LORA_RANK, LORA_ALPHA = 8, 16
PROMPT_LEN, RESPONSE_LEN = 6, 4
TOL = 1e-5


def _ids() -> torch.Tensor:
    return torch.randint(10, 500, (2, 12), generator=torch.Generator().manual_seed(7))


def _worker_config(model_dir: str, lora: bool):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hflow.trainer.main_ppo import CONFIG_DIR

    overrides = [f"actor_rollout_ref.model.path={model_dir}",
                 f"data.max_prompt_length={PROMPT_LEN}", f"data.max_response_length={RESPONSE_LEN}",
                 "actor_rollout_ref.rollout.n=1",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                 "actor_rollout_ref.actor.optim.lr=5e-2"]
    if lora:
        overrides += [f"actor_rollout_ref.model.lora_rank={LORA_RANK}",
                      f"actor_rollout_ref.model.lora_alpha={LORA_ALPHA}"]
    else:  # (hflow refuses an EMA with LoRA)
        overrides += ["actor_rollout_ref.actor.ema.enable=true", "actor_rollout_ref.actor.ema.decay=0.5"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    OmegaConf.resolve(config)
    return config.actor_rollout_ref


def _ppo_batch(seed: int):
    from hflow.protocol import DataProto
    from hflow.utils.torch_functional import compute_position_id_with_mask

    gen, n = torch.Generator().manual_seed(seed), 2
    prompt_lens = torch.randint(2, PROMPT_LEN + 1, (n, 1), generator=gen)
    prompt_mask = (torch.arange(PROMPT_LEN) >= PROMPT_LEN - prompt_lens).long()
    response_mask = (torch.arange(RESPONSE_LEN) < torch.randint(1, RESPONSE_LEN + 1, (n, 1), generator=gen)).long()
    responses = torch.randint(10, 400, (n, RESPONSE_LEN), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=-1)
    return DataProto.from_dict({
        "input_ids": torch.cat([torch.randint(10, 400, (n, PROMPT_LEN), generator=gen) * prompt_mask, responses], -1),
        "responses": responses, "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask), "response_mask": response_mask,
        "advantages": torch.randn(n, RESPONSE_LEN, generator=gen) * response_mask,
    }, meta_info={"temperature": 1.0})


@torch.no_grad()
def _logits(worker) -> torch.Tensor:
    return worker.actor_module(input_ids=_ids()).logits.float().clone()


def _save_main(rank: int, port: int, model_dirs: dict[str, str], out: str) -> None:
    from hflow.workers.fsdp import clean_param_name, local_tensor
    from hflow.workers.fsdp_workers import ActorRolloutRefWorker

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      HFLOW_DEVICE="cpu")
    torch.set_num_threads(1)
    try:
        for case, model_dir in model_dirs.items():
            worker = ActorRolloutRefWorker(_worker_config(model_dir, lora=case == "lora"), role="actor")
            worker.init_model()  # the first one joins the 2-rank gloo group (RANK, MASTER_ADDR, ... above)
            batch = _ppo_batch(seed=rank)
            batch.batch["old_log_probs"] = worker.compute_log_prob(batch).batch["old_log_probs"]
            worker.update_actor(batch)
            logits = {"live": _logits(worker)}
            worker.save_checkpoint(f"{out}/{case}/global_step_1/actor", global_step=1)
            if worker.actor_ema is not None:  # the EMA model: the actor's parameters set to their averages
                averages = worker.actor_ema.state_dict()
                with torch.no_grad():
                    for name, param in worker.actor_module.named_parameters():
                        local_tensor(param).copy_(local_tensor(averages[clean_param_name(name)]))
                logits["ema"] = _logits(worker)
            if rank == 0:
                torch.save(logits, f"{out}/{case}/logits.pt")
        dist.barrier()  # leave together: a rank tearing gloo down while its peer is connected can abort it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("convert")
    model_dirs = {"lora": build_causal_lm(root / "qwen2-tied", tie_word_embeddings=True),
                  "full": build_causal_lm(root / "llama", arch="llama")}
    spawn_ranks(_save_main, WORLD, free_port(), {k: str(v) for k, v in model_dirs.items()}, str(root))
    return root


def _converted_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(input_ids=_ids()).logits


def _keys(folder: Path) -> set[str]:
    keys = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            keys |= set(f.keys())
    return keys


def test_lora_checkpoint_of_two_ranks_converts_to_the_trainers_model(saved, tmp_path, capsys):
    ckpt = saved / "lora" / "global_step_1" / "actor"
    assert sorted(ckpt.glob("model_optim/*.distcp")) and len(list(ckpt.glob("model_optim/*.distcp"))) == WORLD
    out = tmp_path / "hf"
    assert main([str(ckpt), str(out), "--verify", "--prompts", "2"]) == 0
    assert "verify OK" in capsys.readouterr().out
    trainer = torch.load(saved / "lora" / "logits.pt")["live"]
    assert (_converted_logits(out) - trainer).abs().max().item() < TOL
    keys = _keys(out)
    assert not any("lora_" in k or "base_model" in k or "base_layer" in k for k in keys)  # merged, plain names
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # tied: one copy
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name


def test_ema_option_converts_the_averaged_weights(saved, tmp_path):
    ckpt = saved / "full" / "global_step_1" / "actor"
    logits = torch.load(saved / "full" / "logits.pt")
    out = convert_checkpoint(ckpt, tmp_path / "ema", ema=True)
    converted = _converted_logits(out)
    assert (converted - logits["ema"]).abs().max().item() < TOL
    assert (converted - logits["live"]).abs().max().item() > 1e-3  # the EMA is not the live model
    assert verify_conversion(ckpt, out, ema=True, prompts=1) < TOL
    with pytest.raises(CheckpointError, match="ema.enable"):
        convert_checkpoint(saved / "lora" / "global_step_1" / "actor", tmp_path / "no_ema", ema=True)
    assert not (tmp_path / "no_ema").exists()


def test_full_finetune_untied_from_the_step_folder_and_bfloat16(saved, tmp_path):
    step = saved / "full" / "global_step_1"  # the step folder: its actor/ is converted
    out = convert_checkpoint(step, tmp_path / "hf")
    assert (_converted_logits(out) - torch.load(saved / "full" / "logits.pt")["live"]).abs().max().item() < TOL
    assert "lm_head.weight" in _keys(out)
    half = convert_checkpoint(step, tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(half / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_bad_inputs_fail_naming_the_folder_and_write_nothing(saved, tmp_path, monkeypatch, capsys):
    ckpt = saved / "lora" / "global_step_1" / "actor"
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        convert_checkpoint(tmp_path, out)
    with pytest.raises(CheckpointError, match="half-written"):
        convert_checkpoint(tmp_path / "actor.incomplete", out)
    with pytest.raises(CheckpointError, match="step folders"):
        convert_checkpoint(saved / "lora", out)
    assert main([str(tmp_path / "missing"), str(out)]) == 2
    assert "missing does not exist" in capsys.readouterr().err

    old = tmp_path / "old" / "actor"  # written before hflow saved config and LoRA settings beside the shards
    shutil.copytree(ckpt, old, ignore=shutil.ignore_patterns("huggingface", "lora"))
    with pytest.raises(CheckpointError, match="--model-path"):
        convert_checkpoint(old, out)
    with pytest.raises(CheckpointError, match="--lora-alpha"):
        convert_checkpoint(old, out, model_path=ckpt / "huggingface")
    assert not out.exists()
    convert_checkpoint(old, out, model_path=ckpt / "huggingface", lora_alpha=LORA_ALPHA)
    trainer = torch.load(saved / "lora" / "logits.pt")["live"]
    assert (_converted_logits(out) - trainer).abs().max().item() < TOL
    with pytest.raises(CheckpointError, match="not empty"):
        convert_checkpoint(ckpt, out)

    import hflow.cli.convert_checkpoint as tool

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed while reading the shards")

    monkeypatch.setattr(tool, "_read", dies)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(ckpt, tmp_path / "never")
    assert not (tmp_path / "never").exists()  # no half-written folder under the final name
