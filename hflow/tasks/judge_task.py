"""A tiny generative judge for the built-in arithmetic task (`reward_model.style=generative` tests).

**Pairs**: for a built-in problem (`hflow.tasks.builtin_task`) and a candidate answer -- the right one,
or one off by -2, -1, +1 or +2 -- the judge's user message is the built-in yes/no template of
`hflow.reward.judge` (question, reference answer, response) and the right reply is ``yes`` exactly when the
candidate equals the answer. The judge is trained on the *training* problems' pairs only (115 problems,
575 pairs); the validation problems' pairs (40 problems, 200 pairs) are held out and are what its
agreement is measured on (`judge_pairs`, `heldout_agreement`).

**Model**: a Qwen2 of the built-in shape (hidden 128, 2 layers, 4 heads of 32) whose tokenizer has
``yes`` and ``no`` as single tokens (`added_tokens`), trained briefly, seeded and single-threaded, with
the cross-entropy of the verdict token only; the right and the wrong candidates of a problem weigh half
each. It learns to compare the response's number with the reference's, so it judges well only with
the reference in its prompt (without it, it would have to do the arithmetic, which it never learned).

**Cache**: `ensure_judge_assets()` builds it once into ``$HFLOW_CACHE/judge-v<VERSION>`` with the
task assets' cache of `hflow.tasks.assets` (`ensure_cached_folder`: temporary folder, completion marker
last, rename, file lock). ``python -m hflow.tasks.judge_task`` builds (or finds) it and prints its info.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from hflow.tasks.assets import (
    deterministic_torch,
    ensure_cached_folder,
    finish_folder,
    fit,
    has_marker,
    init_and_pretrain,
    new_folder,
    pretrained_model,
    prompt_ids,
    quiet_transformers,
    run_cache_command,
)
from hflow.tasks.builtin_task import Problem, builtin_problems, split_problems
from hflow.reward.judge import render_judge_prompt

__all__ = ["OFFSETS", "VERSION", "JudgeAssets", "JudgePair", "JudgeSpec", "ensure_judge_assets", "judge_pairs"]

VERSION = "1"
OFFSETS = (0, -2, -1, 1, 2)  # candidate = answer + offset; 0 is the right one
YES, NO = "yes", "no"
INFO_NAME = "judge_info.json"


@dataclass(frozen=True)
class JudgeSpec:
    num_val_per_op: int = 20  # the built-in task's split
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 256
    steps: int = 300
    problems_per_step: int = 32  # each with all its candidates
    lr: float = 3e-3
    warmup_steps: int = 30
    seed: int = 0


@dataclass(frozen=True)
class JudgeAssets:
    root: str
    model_path: str
    info_file: str


@dataclass(frozen=True)
class JudgePair:
    problem: Problem
    candidate: int
    correct: bool  # candidate == problem.answer

    def user_message(self, with_reference: bool = True) -> str:
        reference = str(self.problem.answer) if with_reference else None
        return render_judge_prompt(None, self.problem.question, str(self.candidate), reference, "yes_no")


def judge_pairs(split: str, num_val_per_op: int = 20) -> list[JudgePair]:
    """Every (problem, candidate) pair of the `split` ("train" or "val") problems, problem-major."""
    train, val = split_problems(builtin_problems(), num_val_per_op)
    problems = {"train": train, "val": val}[split]
    return [JudgePair(p, p.answer + offset, offset == 0) for p in problems for offset in OFFSETS]


def verdict_token_ids(tokenizer) -> tuple[int, int]:
    """The judge's single ``yes`` and ``no`` tokens (its tokenizer adds them as whole tokens)."""
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in (YES, NO)]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"the judge's tokenizer splits yes/no into {ids}; expected one token each")
    return ids[0][0], ids[1][0]


def hf_yes_probabilities(model_dir: str | Path, pairs: list[JudgePair], with_reference: bool = True) -> list[float]:
    """P(yes) / (P(yes) + P(no)) of each pair from one fp32 HF forward (the softmax over the two tokens'
    next-token logits): the reference the vLLM judge is checked against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yes, no = verdict_token_ids(tokenizer)
    out = []
    with torch.no_grad():
        for pair in pairs:
            ids = torch.tensor([prompt_ids(tokenizer, pair.user_message(with_reference))])
            logits = model(input_ids=ids).logits[0, -1].double()
            two = torch.softmax(logits[[yes, no]], dim=-1)
            out.append(float(two[0]))
    return out


def _train(model_dir: Path, pairs: list[JudgePair], spec: JudgeSpec) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    yes, no = verdict_token_ids(tokenizer)
    prompts = [prompt_ids(tokenizer, pair.user_message()) for pair in pairs]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: the verdict is predicted at the last position
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    targets = torch.tensor([yes if pair.correct else no for pair in pairs])
    per_problem = len(OFFSETS)
    weights = torch.tensor([0.5 if pair.correct else 0.5 / (per_problem - 1) for pair in pairs])
    num_problems = len(pairs) // per_problem

    gen = torch.Generator().manual_seed(spec.seed)
    per_step = min(spec.problems_per_step, num_problems)

    def batch_loss() -> torch.Tensor:
        chosen = torch.randperm(num_problems, generator=gen)[:per_step]
        rows = (chosen[:, None] * per_problem + torch.arange(per_problem)).reshape(-1)
        logits = model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=position_ids[rows]).logits[:, -1]
        nll = F.cross_entropy(logits, targets[rows], reduction="none")
        return (nll * weights[rows]).sum() / per_step

    loss = fit(model, spec.steps, spec.lr, spec.warmup_steps, batch_loss)
    model.save_pretrained(str(model_dir))
    return {"final_loss": round(loss.item(), 4), "train_pairs": len(pairs)}


def _build_model(model_dir: Path, spec: JudgeSpec) -> None:
    shape = {k: getattr(spec, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                           "intermediate_size")}
    pairs = judge_pairs("train", spec.num_val_per_op)
    init_and_pretrain(model_dir, spec.seed, shape, lambda: _train(model_dir, pairs, spec),
                       tokenizer_kwargs={"added_tokens": [YES, NO]})


def heldout_agreement(model_dir: str | Path, spec: JudgeSpec, with_reference: bool = True) -> dict:
    """Agreement of ``P(yes | pair) > 0.5`` with the truth on the held-out (validation) pairs, HF forward."""
    pairs = judge_pairs("val", spec.num_val_per_op)
    probs = hf_yes_probabilities(model_dir, pairs, with_reference)
    agree = [(p > 0.5) == pair.correct for p, pair in zip(probs, pairs)]
    return {"pairs": len(pairs), "agreement": round(sum(agree) / len(agree), 4)}


def build_judge_assets(out_dir: str | Path, spec: JudgeSpec = JudgeSpec()) -> JudgeAssets:
    out = new_folder(out_dir, "build_judge_assets")
    model_dir = out / "model"
    with quiet_transformers():
        stats = pretrained_model(lambda: _build_model(model_dir, spec), __name__, model_dir, spec)
        with deterministic_torch(spec.seed):
            report = heldout_agreement(model_dir, spec)
    info = {"version": VERSION, "spec": asdict(spec)}
    sizes = (len(judge_pairs("train", spec.num_val_per_op)), report["pairs"])
    finish_folder(out, INFO_NAME, _marker_text(spec), info, sizes, stats, {"heldout_hf": report})
    return _assets(out)


def _marker_text(spec: JudgeSpec) -> str:
    return json.dumps({"version": VERSION, "spec": asdict(spec)}, sort_keys=True) + "\n"


def _assets(folder: Path) -> JudgeAssets:
    return JudgeAssets(root=str(folder), model_path=str(folder / "model"), info_file=str(folder / INFO_NAME))


def ensure_judge_assets(cache_dir: str | Path | None = None, *, spec: JudgeSpec = JudgeSpec()) -> JudgeAssets:
    """The tiny judge, built on first use into the cache root's ``judge-v<VERSION>`` folder (about a
    minute on 2 CPU cores) and reused afterwards."""
    folder = ensure_cached_folder(
        cache_dir,
        f"judge-v{VERSION}",
        lambda f: has_marker(f, _marker_text(spec), [str(f / INFO_NAME)]),
        lambda tmp: build_judge_assets(tmp, spec),
        "the tiny arithmetic judge (once; about a minute on 2 CPU cores)",
    )
    return _assets(folder)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--_build-model"]:  # internal: the fresh-process model build
        with quiet_transformers():
            _build_model(Path(argv[1]), JudgeSpec(**json.loads(argv[2])))
        return 0
    return run_cache_command(argv[0] if argv else None, lambda: _print_assets(argv[0] if argv else None))


def _print_assets(cache_dir: str | None) -> int:
    assets = ensure_judge_assets(cache_dir)
    print(json.dumps(asdict(assets), indent=2))
    print(Path(assets.info_file).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
