"""Held-out accuracy of a model folder on the example's test set, with vLLM in-process (fp32, CPU).

    python examples/smollm2_arith/evaluate.py --model DIR [--data ~/data/smollm2_arith/test.parquet]
        [--limit 200] [--n 4] [--max-tokens 128] [--json out.json] [--time-batch]

Reports greedy accuracy (what hflow's validation reports as ``val-core/hflow/arithmetic/reward/mean@1``),
and at temperature `--temperature` (default 1) with ``n`` samples: the mean score (mean@n) and the share of problems with at
least one correct sample (pass@n), overall and per operation, plus response lengths. ``--time-batch``
also times one generation of 32 prompts x 4 samples x 64 tokens (the size of one GRPO rollout).
``--instruction TEXT`` (repeatable) replaces the prompt's instruction, to compare phrasings.
Use it on a checkpoint's ``actor/huggingface`` folder to check the trainer's own numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hflow.reward.score.arithmetic import compute_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_data import INSTRUCTION


def summarize(rows, texts_per_row):
    """rows: test rows; texts_per_row: list of lists of responses."""
    by_op = defaultdict(lambda: [0, 0.0, 0])  # count, sum of mean scores, pass count
    for row, texts in zip(rows, texts_per_row):
        scores = [compute_score(t, row["reward_model"]["ground_truth"]) for t in texts]
        for op in ("all", row["extra_info"]["op"]):
            by_op[op][0] += 1
            by_op[op][1] += sum(scores) / len(scores)
            by_op[op][2] += max(scores) > 0
    return {op: {"n": c, "mean": round(s / c, 4), "pass": round(p / c, 4)} for op, (c, s, p) in by_op.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", default=str(Path.home() / "data" / "smollm2_arith" / "test.parquet"))
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for mean@n / pass@n")
    parser.add_argument("--instruction", action="append", default=None)
    parser.add_argument("--time-batch", action="store_true")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0,
                        help="vLLM KV cache; 256 MiB holds only ~20 sequences of this 30-layer model")
    parser.add_argument("--sampled-limit", type=int, default=None, help="sample on only this many problems")
    parser.add_argument("--show", type=int, default=3, help="print this many example responses")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dump", type=Path, help="write every response here (JSONL)")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))  # before vLLM patches it away
    from vllm import LLM, SamplingParams

    rows = pd.read_parquet(args.data).head(args.limit).to_dict("records")
    t0 = time.time()
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
              max_model_len=512, seed=args.seed)
    print(f"engine ready in {time.time() - t0:.1f}s", flush=True)
    results = {"model": args.model, "data": args.data, "limit": len(rows), "n": args.n, "max_tokens": args.max_tokens}

    if args.time_batch:
        conversations = [[{"role": "user", "content": r["prompt"][0]["content"]}] for r in rows[:32]]
        params = SamplingParams(n=4, temperature=1.0, max_tokens=64, ignore_eos=True)
        times = []
        for _ in range(2):
            t0 = time.time()
            llm.chat(conversations, params, use_tqdm=False)
            times.append(round(time.time() - t0, 2))
        results["time_32x4x64_s"] = times
        print(f"32 prompts x 4 samples x 64 tokens (ignore_eos): {times} s", flush=True)
    instructions = args.instruction or [None]
    for i_instr, instruction in enumerate(instructions):
        conversations = []
        for row in rows:
            content = row["prompt"][0]["content"]
            if instruction is not None:
                content = row["extra_info"]["question"] + " " + instruction
            conversations.append([{"role": "user", "content": content}])
        key = instruction or INSTRUCTION
        entry = {}
        t0 = time.time()
        greedy = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
        entry["greedy_s"] = round(time.time() - t0, 1)
        texts = [[o.outputs[0].text] for o in greedy]
        entry["greedy"] = summarize(rows, texts)
        lens = [len(o.outputs[0].token_ids) for o in greedy]
        entry["greedy_len_mean"] = round(statistics.mean(lens), 1)
        entry["greedy_len_clip"] = round(sum(n >= args.max_tokens for n in lens) / len(lens), 3)
        entry["greedy_answer_marker"] = round(sum("answer:" in t[0].lower() for t in texts) / len(texts), 3)
        for row, t in list(zip(rows, texts))[: args.show]:
            print(f"--- [{row['reward_model']['ground_truth']}] {t[0]!r}")
        print(json.dumps({key: entry}), flush=True)
        results[key] = entry
        if i_instr > 0:  # sample with the first instruction only
            continue
        m = args.sampled_limit or len(rows)
        t0 = time.time()
        sampled = llm.chat(conversations[:m], SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens),
                                              use_tqdm=False)
        entry["sampled_s"] = round(time.time() - t0, 1)
        entry[f"sampled_n{args.n}"] = summarize(rows[:m], [[c.text for c in o.outputs] for o in sampled])
        lens = [len(c.token_ids) for o in sampled for c in o.outputs]
        entry["sampled_len_mean"] = round(statistics.mean(lens), 1)
        entry["sampled_len_p90"] = sorted(lens)[int(0.9 * len(lens))]
        entry["sampled_len_clip"] = round(sum(n >= args.max_tokens for n in lens) / len(lens), 3)
        print(json.dumps({key: entry}, indent=1), flush=True)
        if args.dump:
            with args.dump.open("w") as f:
                for row, g, o in zip(rows, greedy, sampled):
                    f.write(json.dumps({"question": row["extra_info"]["question"], "op": row["extra_info"]["op"],
                                        "truth": row["reward_model"]["ground_truth"], "greedy": g.outputs[0].text,
                                        "sampled": [c.text for c in o.outputs]}) + "\n")

    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
