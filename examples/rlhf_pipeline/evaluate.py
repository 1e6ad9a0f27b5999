"""Measure a policy and a reward model of the built-in RLHF task on questions they never trained on.

* The policy's greedy answers to the held-out questions, scored three ways by the hidden preference
  (`hflow.reward.score.answer_style`, which nothing trained on): `exact_correct` (the right number,
  any style), `house_style` (share in the preferred style, right number or not) and `true_score` (the
  preference's own score: 1 right and in the house style, 0.5 right in another style, 0 wrong); and by
  the reward model (`rm_score`, what PPO optimised).
* The reward model alone on the held-out questions' preference pairs: the share it ranks the right way,
  per kind of pair (`number`: same style, the number differs; `style`: both right, the style differs;
  `both`: right in another style against wrong in the house style).

    python examples/rlhf_pipeline/evaluate.py --policy SFT_OR_PPO_FOLDER --reward-model RM_FOLDER

Prints one JSON object. Plain transformers on the CPU, no hflow workers: an independent check of what
the stages produced.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hflow.tasks.rlhf_task import ensure_rlhf_task_data
from hflow.utils.dataset.sources import read_table
from hflow.reward.score.answer_style import HOUSE_STYLE, compute_score, parse


def _prompt_ids(tokenizer, chat: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def greedy_responses(policy_path: str, chats: list[list[dict]], max_new_tokens: int = 16):
    """(prompt ids, response ids through the end-of-turn token, decoded texts) of greedy answers."""
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()
    prompts = [_prompt_ids(tokenizer, c) for c in chats]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as in rollouts
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    responses = []
    for row in out[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        responses.append([t for t in row if t != tokenizer.pad_token_id])
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return prompts, responses, texts


class RewardModel:
    """A reward-model folder scored as PPO's reward worker scores it: the head's output at the last token
    of prompt + response (through the end-of-turn token)."""

    def __init__(self, path: str):
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def scores(self, sequences: list[list[int]], batch_size: int = 256) -> list[float]:
        out: list[float] = []
        for start in range(0, len(sequences), batch_size):
            batch = sequences[start:start + batch_size]
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), self.tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(batch):  # right padding: the last valid token is at len - 1
                ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s)] = 1
            captured = {}
            hook = self.model.score.register_forward_hook(lambda _m, _i, o: captured.setdefault("out", o))
            try:
                self.model(input_ids=ids, attention_mask=mask)
            finally:
                hook.remove()
            last = mask.sum(1) - 1
            out += captured["out"][torch.arange(len(batch)), last, 0].tolist()
        return out

    def encode(self, chat: list[dict], response: str) -> list[int]:
        return (_prompt_ids(self.tokenizer, chat) + self.tokenizer.encode(response, add_special_tokens=False)
                + [self.tokenizer.eos_token_id])


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def evaluate_policy(policy: str, reward_model: RewardModel | None, split: str = "val") -> dict:
    files = ensure_rlhf_task_data()
    table = read_table(files.ppo_val if split == "val" else files.ppo_train, "ppo data")
    chats = table.column("prompt").to_pylist()
    answers = [int(row["ground_truth"]) for row in table.column("reward_model").to_pylist()]
    prompts, responses, texts = greedy_responses(policy, chats)
    parsed = [parse(t) for t in texts]
    styles = [style for style, _ in parsed]
    result = {
        "questions": len(texts),
        "exact_correct": _mean(number == answer for (_, number), answer in zip(parsed, answers)),
        "house_style": _mean(style == HOUSE_STYLE for style in styles),
        "true_score": _mean(compute_score(t, a) for t, a in zip(texts, answers)),
        "styles": {s: styles.count(s) / len(styles) for s in sorted(set(styles))},
        "samples": [f"{c[-1]['content']} -> {t!r}" for c, t in list(zip(chats, texts))[:6]],
    }
    if reward_model is not None:
        result["rm_score"] = _mean(reward_model.scores([p + r for p, r in zip(prompts, responses)]))
    return result


def pair_accuracy(reward_model: RewardModel, split: str = "val") -> dict[str, float]:
    """Share of the split's preference pairs the reward model ranks the way the hidden preference does,
    per kind of pair and over all of them (ties count as wrong)."""
    files = ensure_rlhf_task_data()
    rows = read_table(files.rm_val if split == "val" else files.rm_train, "rm data").to_pylist()
    chosen = reward_model.scores([reward_model.encode(r["prompt"], r["chosen"]) for r in rows])
    rejected = reward_model.scores([reward_model.encode(r["prompt"], r["rejected"]) for r in rows])
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for row, c, r in zip(rows, chosen, rejected):
        by_kind[row["kind"]].append(c > r)
        by_kind["all"].append(c > r)
    return {kind: _mean(hits) for kind, hits in sorted(by_kind.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", required=True, help="Hugging Face folder of the policy")
    parser.add_argument("--reward-model", default=None, help="Hugging Face folder of the reward model")
    parser.add_argument("--split", default="val", choices=["val", "train"])
    args = parser.parse_args()
    rm = RewardModel(args.reward_model) if args.reward_model else None
    result = {"policy": evaluate_policy(args.policy, rm, args.split)}
    if rm is not None:
        result["reward_model_pairs"] = pair_accuracy(rm, args.split)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
