"""Score a policy's greedy answers to the built-in RLHF task's held-out questions, two ways:

* the true score: the hidden rule (`hflow.utils.reward_score.answer_style`), which nothing trained on;
* the reward model's score: what PPO optimised.

    python examples/rlhf_pipeline/evaluate.py --policy SFT_OR_PPO_FOLDER --reward-model RM_FOLDER

Prints one JSON object: {"true_score": mean, "rm_score": mean, "styles": {style: share}, "samples": [...]}.
Plain transformers on the CPU, no hflow workers: an independent check of what the stages produced.
"""

from __future__ import annotations

import argparse
import json
import re

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hflow.utils.dataset.rl_dataset import read_parquet
from hflow.utils.reward_score.answer_style import compute_score
from hflow.tasks.rlhf_task import ensure_rlhf_task_data

_STYLE_PATTERNS = {
    "house": r"The answer is -?\d+\.",
    "plain": r"-?\d+",
    "hedge": r"I think it is -?\d+\.",
    "equation": r"\d+ [+-] \d+ = -?\d+",
}


def style_of(text: str) -> str:
    return next((name for name, pattern in _STYLE_PATTERNS.items() if re.fullmatch(pattern, text.strip())), "other")


@torch.no_grad()
def greedy_responses(policy_path: str, chats: list[list[dict]], max_new_tokens: int = 16):
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as in rollouts
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    responses = out[:, width:]
    return prompts, responses, tokenizer


@torch.no_grad()
def reward_model_scores(rm_path: str, prompts: list[list[int]], responses: torch.Tensor, pad_id: int,
                        eos_id: int) -> list[float]:
    """The reward model's score at the last token of prompt + response (through the end-of-turn token),
    the layout the PPO reward worker scores."""
    model = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    scores = []
    for prompt, response in zip(prompts, responses.tolist()):
        if eos_id in response:
            response = response[: response.index(eos_id) + 1]
        response = [t for t in response if t != pad_id]
        ids = torch.tensor([prompt + response])
        per_token = {}
        hook = model.score.register_forward_hook(lambda _m, _i, out: per_token.setdefault("out", out))
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
        hook.remove()
        scores.append(float(per_token["out"][0, -1, 0]))
    return scores


def evaluate(policy: str, reward_model: str | None, split: str = "val") -> dict:
    files = ensure_rlhf_task_data()
    table = read_parquet(files.ppo_val if split == "val" else files.ppo_train, "ppo data")
    chats = table.column("prompt").to_pylist()
    answers = [row["ground_truth"] for row in table.column("reward_model").to_pylist()]
    prompts, responses, tokenizer = greedy_responses(policy, chats)
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    true_scores = [compute_score(t, a) for t, a in zip(texts, answers)]
    styles = [style_of(t) for t in texts]
    result = {"true_score": sum(true_scores) / len(true_scores),
              "styles": {s: styles.count(s) / len(styles) for s in sorted(set(styles))},
              "samples": [f"{c[-1]['content']} -> {t!r}" for c, t in list(zip(chats, texts))[:4]]}
    if reward_model:
        rm = reward_model_scores(reward_model, prompts, responses, tokenizer.pad_token_id, tokenizer.eos_token_id)
        result["rm_score"] = sum(rm) / len(rm)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", required=True, help="Hugging Face folder of the policy")
    parser.add_argument("--reward-model", default=None, help="Hugging Face folder of the reward model")
    parser.add_argument("--split", default="val", choices=["val", "train"])
    args = parser.parse_args()
    print(json.dumps(evaluate(args.policy, args.reward_model, args.split)))


if __name__ == "__main__":
    main()
