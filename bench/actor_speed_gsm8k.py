"""`python bench/actor_speed.py --workload gsm8k`: the training side of a GRPO step on GSM8K-like data, in one
process, arm by arm (issue 49; the GPU probe of the CUDA defaults).

Each step runs what the trainer runs on the training devices after generation, with the KL loss on: the old
log-prob pass, the reference's log-prob pass, and the actor's update over two mini-batches. The batch has
GSM8K's shape of lengths (prompts of 60-220 tokens, responses of 40-760, drawn once per run from a fixed seed;
the tiny CPU shape scales them down), left-padded prompts and right-padded responses as the rollout returns
them. Three steps per arm after a warm-up step; per phase the median of the three.

Arms (hflow's built by the worker's own `_build_trainable` from the trainer's config, as `actor_speed.py`'s):
  G0   the defaults of this device (`resolve_device_defaults`: on CUDA packed rows, the memory plan's
       token-budget micro-batches, fused AdamW; FSDP2 left out on one rank, which only casts)
  G1   G0 with FSDP2 forced on the one rank: the hooks every rank of an 8-GPU run pays
  G2   G1 + use_torch_compile (CUDA)
  G3   G1 + use_liger (CUDA, liger-kernel)
  P    the plain loop given the same layout: one micro-batch per mini-batch (padded: a plain loop has no
       varlen attention), the same losses, fp32 weights under bf16 autocast, fused AdamW
  G0b  G0 again (clock or thermal drift)
Per arm: the phases' times, the update's MFU (hflow's FLOP count over the real tokens), compiled graphs and
Dynamo's recompile-limit hits, peak memory beside the memory plan's prediction for the update (planned once, in
a child process given PLAN_TIMEOUT_S: past it the largest token budget is used and the row says so). The files
are rewritten after every arm.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

STEPS = 3


@dataclass
class Workload:
    model: dict[str, Any]
    sequences: int  # per step (two mini-batches)
    prompt: tuple[int, int]  # length range, tokens
    response: tuple[int, int]
    max_prompt: int
    max_response: int


WORKLOADS = {
    "cuda": Workload(dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                          intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768,
                          rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
                     64, (60, 220), (40, 760), 256, 768),
    "cpu": Workload(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True),
                    8, (6, 16), (4, 40), 16, 48),
}


@dataclass
class GArm:
    key: str
    what: str
    overrides: dict[str, Any] = field(default_factory=dict)
    fsdp_forced: bool = False
    plain: bool = False
    needs: tuple[str, ...] = ()


COMPILE = {"actor_rollout_ref.model.use_torch_compile": True}
LIGER = {"actor_rollout_ref.model.use_liger": True}
ARMS = [
    GArm("G0", "the defaults of this device"),
    GArm("G1", "G0 + FSDP2 forced on the one rank", fsdp_forced=True),
    GArm("G2", "G1 + use_torch_compile", COMPILE, fsdp_forced=True, needs=("cuda",)),
    GArm("G3", "G1 + use_liger", LIGER, fsdp_forced=True, needs=("cuda", "liger_kernel")),
    GArm("P", "plain loop, one micro-batch per mini-batch (padded), fp32 + bf16 autocast, fused AdamW", plain=True),
    GArm("G0b", "G0 again (drift)"),
]


def make_batch(work: Workload, vocab: int, seed: int = 0):
    """Left-padded prompts and right-padded responses of GSM8K-like lengths, with advantages."""
    import torch

    from hflow.protocol import DataProto
    from hflow.utils.torch_functional import compute_position_id_with_mask

    gen = torch.Generator().manual_seed(seed)
    n, P, R = work.sequences, work.max_prompt, work.max_response
    prompts = torch.randint(work.prompt[0], work.prompt[1] + 1, (n,), generator=gen)
    responses = torch.randint(work.response[0], work.response[1] + 1, (n,), generator=gen)
    ids = torch.randint(0, vocab, (n, P + R), generator=gen)
    mask = torch.zeros(n, P + R, dtype=torch.long)
    for i in range(n):
        mask[i, P - int(prompts[i]):P + int(responses[i])] = 1
    response_mask = mask[:, P:].clone()
    batch = DataProto.from_dict({
        "input_ids": ids, "responses": ids[:, P:], "attention_mask": mask,
        "position_ids": compute_position_id_with_mask(mask), "response_mask": response_mask,
        "advantages": torch.randn(n, R, generator=gen) * response_mask,
    }, meta_info={"temperature": 1.0})
    seqlens = (prompts + responses).tolist()
    return batch, seqlens, int(responses.sum())


def workload_config(work: Workload, model_dir: str, cuda: bool, budget: int | None = None):
    """The trainer's config for the workload: GRPO with the KL loss, two mini-batches per step, the device's
    defaults resolved as a run resolves them (on CUDA with the memory plan's token budget, or `budget`)."""
    from omegaconf import OmegaConf, open_dict

    from hflow.trainer.config import default_config
    from hflow.trainer.memory.defaults import resolve_for_run

    config = default_config()
    updates = {"actor_rollout_ref.model.path": model_dir, "algorithm.adv_estimator": "grpo",
               "data.max_prompt_length": work.max_prompt, "data.max_response_length": work.max_response,
               "data.train_batch_size": work.sequences // 4, "actor_rollout_ref.rollout.n": 4,
               "actor_rollout_ref.actor.ppo_mini_batch_size": work.sequences // 8,  # two mini-batches
               # counted micro-batches (CPU's default): one per mini-batch, as the plain loop's
               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": work.sequences // 2,
               "actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.shuffle": False,
               "trainer.n_gpus_per_node": 1}
    if budget is not None and cuda:
        updates["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] = budget
    with open_dict(config):
        for key, value in updates.items():
            OmegaConf.update(config, key, value, merge=False)
        resolve_for_run(config, target="cuda" if cuda else "cpu")
    return config


PLAN_TIMEOUT_S = 150.0  # the memory plan of a 1.5B shape took minutes on a loaded CPU: the probe must not wait on it


def _plan_in_child(work: Workload, model_dir: str, cuda: bool, queue) -> None:
    config = workload_config(work, model_dir, cuda)
    queue.put((int(config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu), *predicted_update_gib(config, cuda)))


def planned_defaults(work: Workload, model_dir: str, cuda: bool, log=print):
    """The workload's config with the device's defaults, and the memory plan's update figure and note: planned
    in a child process given PLAN_TIMEOUT_S; past it, the largest token budget and no figure (said in the note)."""
    import multiprocessing

    from omegaconf import open_dict

    from hflow.workers.config import GPU_TOKEN_BUDGETS

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_plan_in_child, args=(work, model_dir, cuda, queue), daemon=True)
    child.start()
    child.join(PLAN_TIMEOUT_S)
    if child.is_alive() or child.exitcode != 0:
        child.terminate()
        budget, predicted, note = GPU_TOKEN_BUDGETS[0], None, f"no plan within {PLAN_TIMEOUT_S:.0f} s (exit {child.exitcode})"
    else:
        budget, predicted, note = queue.get()
    log(f"actor_speed gsm8k: token budget {budget}, memory plan: {predicted} GiB ({note})")
    config = workload_config(work, model_dir, cuda, budget)
    return config, predicted, note


def with_overrides(config, overrides: dict[str, Any]):
    from omegaconf import OmegaConf, open_dict

    config = config.copy()
    with open_dict(config):
        for key, value in overrides.items():
            OmegaConf.update(config, key, value, merge=False)
    return config


def predicted_update_gib(config, cuda: bool) -> tuple[float | None, str]:
    """The memory plan's figure for the actor's update phase (GiB) and a note (the plan's time, or why there is
    no figure)."""
    from hflow.trainer.memory.plan import plan_memory

    started = time.perf_counter()
    try:
        plan = plan_memory(config, "cuda" if cuda else "cpu")
    except Exception as err:  # noqa: BLE001 - recorded; the measurement goes on
        return None, f"no plan: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    phases = [p for p in plan.phases if p.name == "actor update"]
    figure = phases[0].total / 2**30 if phases else None
    return figure, f"planned in {time.perf_counter() - started:.0f} s"


@contextlib.contextmanager
def fsdp_on_one_rank(forced: bool):
    from hflow.workers.fsdp import sharding

    needed = sharding.fsdp_needed
    if forced:
        sharding.fsdp_needed = lambda *args, **kwargs: True
    try:
        yield
    finally:
        sharding.fsdp_needed = needed


def hflow_arm(arm: GArm, config, hf_config, state: dict, batch, mesh) -> tuple[dict[str, Callable[[], Any]], dict]:
    """The three phases of a step on hflow's actor and reference, built as the worker builds them, and what the
    arm ran (whether FSDP2 wraps the actor; the last update's KL loss, once it ran)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from hflow.utils import device
    from hflow.workers.actor import DataParallelPPOActor
    from hflow.workers.config import normalize_actor_rollout_ref
    from hflow.workers.fsdp import default_attn_implementation
    from hflow.workers.fsdp_workers import FSDPModelHolder

    arr = normalize_actor_rollout_ref(config.actor_rollout_ref, "actor_rollout_ref", 1)
    holder = type("OneRank", (), {"device_mesh": mesh})()

    def build(train: bool):
        with torch.device(device.get_device()):
            model = Qwen2ForCausalLM._from_config(hf_config, attn_implementation=default_attn_implementation(),
                                                  dtype=torch.float32)
        model.load_state_dict(state)
        section = arr.actor if train else arr.ref
        with fsdp_on_one_rank(arm.fsdp_forced):
            return FSDPModelHolder._build_trainable(
                holder, model, section.fsdp_config, arr.actor.optim if train else None,
                gradient_checkpointing=bool(arr.model.enable_gradient_checkpointing) and train, train=train,
                kernels=arr.model, role="actor" if train else "ref")

    module, optimizer, _ = build(True)
    ref_module, _, _ = build(False)
    actor = DataParallelPPOActor(arr.actor, module, optimizer)
    ref = DataParallelPPOActor(arr.ref, ref_module)
    data = batch.to(device.get_device())
    if arr.actor.use_dynamic_bsz:
        data.meta_info.update(use_dynamic_bsz=True, max_token_len=int(arr.actor.ppo_max_token_len_per_gpu))
    else:
        data.meta_info["micro_batch_size"] = int(arr.actor.ppo_micro_batch_size_per_gpu)

    def old_log_prob():
        data.batch["old_log_probs"] = actor.compute_log_prob(data, calculate_entropy=False)[0]

    def ref_log_prob():
        data.batch["ref_log_prob"] = ref.compute_log_prob(data, calculate_entropy=False)[0]

    def update_actor():
        info["kl_loss"] = float(actor.update_policy(data)["actor/kl_loss"][-1])  # the second mini-batch's

    from torch.distributed.fsdp import FSDPModule

    info = {"fsdp2": isinstance(module, FSDPModule)}  # what the arm really ran: FSDP2's hooks or a plain module
    return {"old_log_prob": old_log_prob, "ref_log_prob": ref_log_prob, "update_actor": update_actor}, info


def plain_arm(hf_config, state: dict, batch, kl_coef: float) -> dict[str, Callable[[], Any]]:
    """The same step as a plain loop: each mini-batch one micro-batch, padded to its longest sequence."""
    import torch
    from transformers import Qwen2ForCausalLM

    from hflow.utils import device

    dev = device.get_device()
    half = torch.bfloat16
    with torch.device(dev):
        model = Qwen2ForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
        ref = Qwen2ForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=half)
    model.load_state_dict(state)
    ref.load_state_dict(state)
    ref.eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.is_cuda())
    b = batch.batch
    R = b["responses"].shape[1]
    halves = [slice(0, len(batch) // 2), slice(len(batch) // 2, len(batch))]
    stored: dict[str, list[torch.Tensor]] = {}

    def log_probs(net, rows, grad: bool):
        mask = b["attention_mask"][rows].to(dev)
        keep = mask.sum(0).nonzero()  # the columns some row of the mini-batch uses
        lo, hi = int(keep[0]), int(keep[-1]) + 1
        ids, mask = b["input_ids"][rows, lo:hi].to(dev), mask[:, lo:hi]
        width = hi - (b["input_ids"].shape[1] - R)  # response columns kept
        with torch.set_grad_enabled(grad), torch.autocast(dev.type, dtype=half, enabled=net is model):
            logits = net(input_ids=ids, attention_mask=mask, use_cache=False,
                         logits_to_keep=width + 1).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, -width:, None]).squeeze(-1)
        return torch.nn.functional.pad(lp, (0, R - width))

    def passes(name, net):
        def run():
            stored[name] = [log_probs(net, rows, False) for rows in halves]
        return run

    def update():
        for i, rows in enumerate(halves):
            lp = log_probs(model, rows, True)
            m = b["response_mask"][rows].to(dev).float()
            adv = b["advantages"][rows].to(dev)
            ratio = torch.exp(lp - stored["old"][i])
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
            delta = stored["ref"][i] - lp
            kl = (torch.exp(delta) - delta - 1).clamp(-10, 10)  # low_var_kl (k3)
            ((pg + kl_coef * kl) * m).sum().div(m.sum()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return {"old_log_prob": passes("old", model), "ref_log_prob": passes("ref", ref), "update_actor": update}, {}


def run(arm_keys: list[str], out: Path, command: str, log=print, budget_s: float | None = None) -> dict[str, Any]:
    """Measure the arms; rewrite out/actor_speed_gsm8k.{md,json} after each."""
    import importlib.util
    import json
    import tempfile

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hflow.utils import device
    from hflow.utils.flops_counter import device_peak_flops, training_flops
    from hflow.workers.fsdp.kernels import compile_metrics

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # its helpers, when imported from elsewhere
    from actor_speed import environment, one_rank_mesh, peak_gib, reset_peak, sync

    cuda = device.is_cuda()
    work = WORKLOADS["cuda" if cuda else "cpu"]
    hf_config = Qwen2Config(**work.model)
    model_dir = tempfile.mkdtemp(prefix="hflow-gsm8k-shape-")
    hf_config.save_pretrained(model_dir)  # the memory plan reads the model's config.json; the arms load `state`,
    (Path(model_dir) / "model.safetensors").touch()  # so the folder's weights file (which the config check asks for) stays empty
    torch.manual_seed(0)
    with torch.device(device.get_device()):
        source = Qwen2ForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    state = {k: v.detach().cpu().clone() for k, v in source.state_dict().items()}
    del source
    batch, seqlens, response_tokens = make_batch(work, hf_config.vocab_size)
    train = training_flops(hf_config, seqlens, lm_head_tokens=response_tokens)
    peak = device_peak_flops()
    arms = {a.key: a for a in ARMS}
    rows: list[dict[str, Any]] = []
    begun = time.perf_counter()
    # the defaults and the memory plan's figure once: the kernel options and FSDP2 on one rank leave both alone
    base, predicted, plan_note = planned_defaults(work, model_dir, cuda, log)
    result = {"environment": environment(), "workload": {**work.model, "sequences": work.sequences,
              "prompt_lengths": work.prompt, "response_lengths": work.response, "tokens": sum(seqlens),
              "response_tokens": response_tokens}, "steps": STEPS, "rows": rows}

    def write():
        (out / "actor_speed_gsm8k.json").write_text(json.dumps({"command": command, **result}, indent=1) + "\n")
        (out / "actor_speed_gsm8k.md").write_text(markdown(result, command))

    for key in arm_keys:
        arm = arms[key]
        row: dict[str, Any] = {"arm": key, "what": arm.what}
        missing = [n for n in arm.needs if (n == "cuda" and not cuda) or (n != "cuda" and importlib.util.find_spec(n) is None)]
        if missing or (budget_s is not None and time.perf_counter() - begun > budget_s):
            row.update(status="SKIPPED", note=f"needs {missing[0]}" if missing else "the run's --budget-s was spent")
            rows.append(row)
            log(f"actor_speed gsm8k: {key}: skipped ({row['note']})")
            write()
            continue
        log(f"actor_speed gsm8k: {key}: {arm.what} ...")
        started = time.perf_counter()
        before = compile_metrics()
        phases = info = None
        try:
            config = with_overrides(base, arm.overrides)
            row["layout"] = {k: config.actor_rollout_ref.actor[k] for k in ("use_dynamic_bsz", "ppo_max_token_len_per_gpu")}
            if not arm.plain:
                row.update(predicted_update_gib=predicted, plan_note=plan_note)
            reset_peak()
            phases, info = (plain_arm(hf_config, state, batch, float(config.actor_rollout_ref.actor.kl_loss_coef))
                            if arm.plain else hflow_arm(arm, config, hf_config, state, batch, one_rank_mesh()))
            times: dict[str, list[float]] = {name: [] for name in phases}
            for step in range(STEPS + 1):  # the first is a warm-up (and compiles)
                for name, phase in phases.items():
                    sync()
                    t0 = time.perf_counter()
                    phase()
                    sync()
                    if step:
                        times[name].append(time.perf_counter() - t0)
            row.update(status="OK", peak_gib=peak_gib(), **{f"{n}_s": statistics.median(t) for n, t in times.items()})
            row["step_s"] = sum(row[f"{n}_s"] for n in phases)
            row.update(info)
            row["update_mfu"] = train / row["update_actor_s"] / peak if peak else None
            after = compile_metrics()
            row["compile"] = {k: v - before.get(k, 0.0) if "graphs/" in k or "hits" in k else v
                              for k, v in after.items() if v != before.get(k)}
        except torch.OutOfMemoryError:
            row.update(status="OOM", note="out of device memory")
        except Exception as err:  # noqa: BLE001 - recorded, and the next arm runs
            row.update(status="ERROR", note=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}")
            log(traceback.format_exc())
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        phases = info = None  # the arm's models and optimizer go before the next arm builds its own
        reset_peak()
        log(f"actor_speed gsm8k: {key}: {row['status']} in {row['seconds']:.1f} s")
        write()
    return result


def markdown(result: dict[str, Any], command: str) -> str:
    def f(v, fmt="{:.3f}"):
        return "n/a" if v is None else fmt.format(v)

    w = result["workload"]
    lines = [f"# Actor speed, GSM8K-like GRPO step: {w['num_hidden_layers']} layers x {w['hidden_size']}, "
             f"{w['sequences']} sequences, {w['tokens']} tokens ({w['response_tokens']} response)", "",
             f"`{command}`", "", "; ".join(f"{k} {v}" for k, v in result["environment"].items()), "",
             f"Median of {result['steps']} steps after a warm-up step. Two mini-batches per update, KL loss on. "
             "MFU: hflow's FLOP count over the real (unpadded) tokens. Plan: the memory plan's update phase.", "",
             "| arm | what | status | old log-prob s | ref log-prob s | update s | step s | update MFU | peak GiB | "
             "plan GiB | graphs | recompile-limit hits | layout |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "OK":
            lines.append(f"| {r['arm']} | {r['what']} | {r['status']}: {r.get('note', '')} |" + " |" * 10)
            continue
        compiled = r.get("compile") or {}
        graphs = sum(v for k, v in compiled.items() if k.startswith("compile/graphs/"))
        layout = r.get("layout") or {}
        mfu = "n/a" if r["update_mfu"] is None else f"{100 * r['update_mfu']:.1f} %"
        shape = (f"packed, {layout.get('ppo_max_token_len_per_gpu')}-token budget" if layout.get("use_dynamic_bsz")
                 else "padded, by count")
        lines.append(f"| {r['arm']} | {r['what']} | OK | {f(r['old_log_prob_s'])} | {f(r['ref_log_prob_s'])} | "
                     f"{f(r['update_actor_s'])} | {f(r['step_s'])} | {mfu} | {f(r['peak_gib'], '{:.1f}')} | "
                     f"{f(r.get('predicted_update_gib'), '{:.1f}')} | {graphs:g} | "
                     f"{compiled.get('compile/recompile_limit_hits', 0):g} | {'see what' if r['arm'] == 'P' else shape} |")
    return "\n".join(lines) + "\n"
