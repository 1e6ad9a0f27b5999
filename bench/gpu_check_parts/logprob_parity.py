"""Part b, log-prob parity: do the sampler and the trainer agree on the probability of the tokens sampled?
PPO's ratio assumes they do, and bf16 can break it. The built-in model in FSDP2 (bf16 mixed precision on a
1-rank mesh) samples with HFRollout; DataParallelPPOActor.compute_log_prob scores the same tokens with the
training forward. Mean and max |p_sampler - p_trainer| over the response tokens; target mean <= 1e-2."""

from __future__ import annotations

from pathlib import Path

from .common import Part, actor_config, mesh

TITLE = "log-prob parity: HF generation vs FSDP2 bf16 forward"
TARGET = "mean |Δp| <= 1e-2"


def run(part: Part, smoke: bool, workdir: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from hflow.config_schema import default_section
    from hflow.protocol import DataProto
    from hflow.utils import device
    from hflow.tasks.builtin_task import ensure_builtin_assets
    from hflow.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from hflow.workers.fsdp import apply_fsdp2, load_causal_lm
    from hflow.workers.actor import DataParallelPPOActor
    from hflow.workers.rollout import HFRollout

    assets = ensure_builtin_assets()
    tokenizer = AutoTokenizer.from_pretrained(assets.model_path)
    n_samples, response_length = (2, 8) if smoke else (8, 8)
    dataset = RLHFDataset(assets.val_file, tokenizer, default_section("data", max_prompt_length=32),
                          files_key="data.val_files")
    items = [dataset[i] for i in range(min(len(dataset), 8 if smoke else 40))]
    prompts = DataProto.from_single_dict(collate_fn(items))
    prompts = prompts.select(batch_keys=["input_ids", "attention_mask", "position_ids"])

    torch.manual_seed(0)
    model = load_causal_lm(assets.model_path, dtype=torch.float32)
    apply_fsdp2(model, mesh())  # the actor's set-up: fp32 master weights, bf16 compute on GPU
    eos = getattr(model.generation_config, "eos_token_id", None)
    prompts.meta_info.update(eos_token_id=eos if eos is not None else tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    rollout_config = default_section("actor_rollout_ref.rollout", response_length=response_length, n=n_samples,
                                     temperature=1.0)
    # Not ignore_eos: HF implements it as min_new_tokens, which takes EOS out of the distribution the
    # sampler's log-probs come from, so they would differ from the trainer's by design.
    rollout = HFRollout(model, rollout_config)
    output = rollout.generate_sequences(prompts.to(device.get_device()))
    actor = DataParallelPPOActor(actor_config(), model)
    output.meta_info.update(temperature=1.0, micro_batch_size=64)
    log_probs, _ = actor.compute_log_prob(output)

    mask = output.batch["attention_mask"][:, -response_length:].bool()
    sampler = output.batch["rollout_log_probs"].float()[mask]
    trainer = log_probs.float()[mask]
    dp = (sampler.exp() - trainer.exp()).abs()
    dlogp = (sampler - trainer).abs()
    mean_dp, max_dp = float(dp.mean()), float(dp.max())
    part.data.update(tokens=int(mask.sum()), mean_abs_dp=mean_dp, max_abs_dp=max_dp,
                     mean_abs_dlogp=float(dlogp.mean()), max_abs_dlogp=float(dlogp.max()),
                     param_dtype=str(next(iter(model.parameters())).dtype))
    part.result = f"mean |Δp| {mean_dp:.2e}, max |Δp| {max_dp:.2e} over {int(mask.sum())} tokens"
    part.status = "PASS" if mean_dp <= 1e-2 else "FAIL"
    part.details += [
        f"model: the built-in model ({assets.model_path}), {len(items)} validation prompts x {n_samples} samples "
        f"x up to {response_length} tokens at temperature 1; the response tokens up to and including EOS count",
        "sampler: `HFRollout` (HF `generate`, KV cache) on the FSDP2 module; trainer: "
        "`DataParallelPPOActor.compute_log_prob` on the same module (full forward); both in "
        f"{'bf16 (FSDP2 mixed precision)' if device.is_cuda() else 'fp32'}",
        f"|Δ log p|: mean {float(dlogp.mean()):.2e}, max {float(dlogp.max()):.2e}",
    ]
    del model, actor, rollout

