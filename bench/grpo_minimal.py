"""The minimal GRPO loop: the practical limit of one machine for the work `bench/grpo_step.py` measures.

    python bench/grpo_minimal.py --spec SPEC.json --out RESULT.json

One process, no Ray, no FSDP, no DataProto: the same in-process vLLM engine hflow uses (same
arguments, same `reload_weights` sync) for generation, and plain torch for everything else. Each
iteration does exactly hflow's arithmetic for the spec (`grpo_step.py` writes the matching hflow
overrides): n samples per prompt of exactly `response_length` tokens at `temperature`, rule-based
reward, log-probs of the sampled tokens under the policy (logits / T; skipped with
`reuse_update_log_probs`, as in hflow and TRL) and under the frozen reference, GRPO advantages,
one AdamW step over the whole batch in micro-batches with the PPO clipped loss plus the
low-variance KL loss, token-mean over the batch, gradient clipping at 1.0.
The rows are padded only to the batch's longest prompt (what any hand-written loop does).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    # vLLM's CPU backend pins the torch thread count when the engine starts; this sets what it pins.
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))

    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from vllm import LLM, SamplingParams, TokensPrompt

    from hflow.algorithms.core_algos import compute_grpo_outcome_advantage, compute_policy_loss, kl_penalty
    from hflow.reward.score.arithmetic import compute_score
    from hflow.utils.torch_functional import get_response_mask, logprobs_from_logits
    from hflow.utils.flops_counter import training_flops
    from hflow.workers.rollout.vllm_rollout import CPU_DEFAULT_KV_CACHE_BYTES, _retie_lm_head

    torch.manual_seed(spec["seed"])
    B, n, L, T = spec["batch_prompts"], spec["n"], spec["response_length"], spec["temperature"]
    micro = spec["micro_batch_size"]

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    rows = pd.read_parquet(spec["train_file"]).head(B * spec["iterations"])
    prompts = [
        tokenizer(tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        for p in rows["prompt"]
    ]
    truths = [r["ground_truth"] for r in rows["reward_model"]]

    policy = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    policy.config.use_cache = False
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=spec["lr"], betas=(0.9, 0.999), weight_decay=0.01)
    kv_cache_bytes = spec["kv_cache_bytes"] or CPU_DEFAULT_KV_CACHE_BYTES  # None: what hflow's engine gets
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, seed=spec["seed"], load_format="dummy",
              max_model_len=spec["max_prompt_length"] + L, kv_cache_memory_bytes=kv_cache_bytes,
              enable_prefix_caching=True, max_num_batched_tokens=8192, max_num_seqs=256)
    tied = bool(policy.config.tie_word_embeddings)
    ignore_eos = spec.get("ignore_eos", True)
    sampling = SamplingParams(n=n, temperature=T, max_tokens=L, ignore_eos=ignore_eos, logprobs=0, detokenize=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:  # the stop tokens hflow uses: the generation config's, else the tokenizer's
        eos_token_id = GenerationConfig.from_pretrained(spec["model"]).eos_token_id
    except OSError:
        eos_token_id = None
    eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id

    def forward_log_probs(model, input_ids, attention_mask, position_ids) -> torch.Tensor:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=L + 1).logits[:, :-1]
        return logprobs_from_logits(logits / T, input_ids[:, -L:])

    @torch.no_grad()
    def score_all(model, *tensors) -> torch.Tensor:
        return torch.cat([forward_log_probs(model, *(t[i:i + micro] for t in tensors))
                          for i in range(0, len(tensors[0]), micro)])

    iterations = []
    for it in range(spec["iterations"]):
        batch_prompts = prompts[it * B:(it + 1) * B]
        batch_truths = truths[it * B:(it + 1) * B]
        phases: dict[str, float] = {}
        start = time.perf_counter()

        # weight sync, then generation
        t0 = time.perf_counter()
        with torch.no_grad():
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(policy.named_parameters())})
            if tied:
                llm.collective_rpc(_retie_lm_head)
            llm.reset_prefix_cache()
        phases["weight_sync"] = time.perf_counter() - t0
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch_prompts], sampling, use_tqdm=False)
        responses = [list(s.token_ids) for o in outputs for s in sorted(o.outputs, key=lambda s: s.index)]
        phases["gen"] = time.perf_counter() - t0 - phases["weight_sync"]

        # one row per sample: the prompt left-padded to the batch's longest, then the response
        P = max(len(p) for p in batch_prompts)
        input_ids = torch.full((B * n, P + L), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, prompt in enumerate(batch_prompts):
            for j in range(n):
                row = i * n + j
                input_ids[row, P - len(prompt):P] = torch.tensor(prompt)
                input_ids[row, P:P + len(responses[row])] = torch.tensor(responses[row])  # pad after an EOS stop
                attention_mask[row, P - len(prompt):P] = 1
        # a response ends at its first EOS (with ignore_eos sampling went on after it), as in hflow
        response_mask = get_response_mask(input_ids[:, P:], eos_token_id, dtype=torch.long)
        response_mask &= torch.arange(L) < torch.tensor([len(r) for r in responses])[:, None]
        attention_mask[:, P:] = response_mask
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        tensors = (input_ids, attention_mask, position_ids)
        lengths = response_mask.sum(-1)
        response_mask = response_mask.float()

        t0 = time.perf_counter()
        texts = tokenizer.batch_decode([r[:k] for r, k in zip(responses, lengths.tolist())], skip_special_tokens=True)
        scores = torch.tensor([compute_score(text, batch_truths[k // n]) for k, text in enumerate(texts)])
        phases["reward"] = time.perf_counter() - t0

        old_log_probs = None  # on-policy update: its own detached log-probs are the old ones
        if not spec.get("reuse_update_log_probs", False):
            t0 = time.perf_counter()
            old_log_probs = score_all(policy, *tensors)
            phases["old_log_prob"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref_log_probs = score_all(reference, *tensors)
        phases["ref"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        token_rewards = torch.zeros_like(response_mask)
        token_rewards[torch.arange(B * n), lengths - 1] = scores  # on each response's last token
        advantages, _ = compute_grpo_outcome_advantage(token_rewards, response_mask, [k // n for k in range(B * n)])
        phases["adv"] = time.perf_counter() - t0

        # one optimizer step over the batch; token-mean with the batch's token count as denominator
        t0 = time.perf_counter()
        num_tokens = response_mask.sum()
        policy.train()
        optimizer.zero_grad(set_to_none=True)
        for i in range(0, B * n, micro):
            sl = slice(i, i + micro)
            log_probs = forward_log_probs(policy, *(t[sl] for t in tensors))
            mask = response_mask[sl]
            old = log_probs.detach() if old_log_probs is None else old_log_probs[sl]
            pg_loss, *_ = compute_policy_loss(old, log_probs, advantages[sl], mask,
                                              cliprange=spec["clip_ratio"], loss_agg_mode="token-mean")
            kl = kl_penalty(log_probs, ref_log_probs[sl], "low_var_kl")
            # compute_policy_loss averages over this micro-batch; rescale to the batch-wide mean
            loss = (pg_loss * mask.sum() + spec["kl_coef"] * (kl * mask).sum()) / num_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        phases["update_actor"] = time.perf_counter() - t0

        phases["step"] = time.perf_counter() - start
        # the work done: with ignore_eos every response is L tokens long, wherever its first EOS is
        generated = torch.tensor([len(r) for r in responses]).float()
        # the update's model FLOPs, counted as hflow's perf/mfu/actor counts them (valid tokens only)
        update_flops = training_flops(policy.config, attention_mask.sum(-1).tolist(), lm_head_tokens=int(num_tokens))
        iterations.append({"phases": phases, "reward_mean": scores.mean().item(), "update_flops": update_flops,
                           "tokens": n * sum(len(p) for p in batch_prompts) + int(generated.sum()),
                           "response_length_mean": generated.mean().item()})
        print(f"[minimal] iteration {it}: {phases['step']:.2f}s  " +
              " ".join(f"{k}={v:.2f}" for k, v in phases.items()), file=sys.stderr, flush=True)

    result = {
        "system": "minimal",
        "threads": torch.get_num_threads(),
        "iteration_s": [r["phases"]["step"] for r in iterations],
        "phases_s": {k: [r["phases"].get(k, 0.0) for r in iterations] for k in iterations[0]["phases"]},
        "reward_mean": [r["reward_mean"] for r in iterations],
        "tokens_per_iteration": [r["tokens"] for r in iterations],
        "response_length_mean": [r["response_length_mean"] for r in iterations],
        "update_flops": [r["update_flops"] for r in iterations],
        "warmup": spec["warmup"],
    }
    args.out.write_text(json.dumps(result, indent=1))
    measured = result["iteration_s"][spec["warmup"]:]
    print(f"[minimal] median iteration {statistics.median(measured):.2f}s over {len(measured)}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
