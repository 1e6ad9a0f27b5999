"""The memory plan: peak device memory of every phase of a PPO/GRPO step, on every rank, before launch.

    python -m hflow.cli.memory_plan <the same key=value overrides as hflow.trainer.main_ppo>  (the command line)
        [--device-memory-gb G] [--target cuda|cpu] [--no-remedies] [--out plan.md]

For the composed configuration and the model's config (config.json only: no weight is read) it prints a
table phase x (components, peak GiB per rank), names the phase that does not fit in one device's memory
and the keys that would make it fit, cheapest first, each with the plan's figure after the change.

How it counts. What torch allocates is counted by running the pass itself -- the model built from its
config on fake tensors, sharded by FSDP2 over a fake process group of the run's world size, the actor's
log-prob / entropy code, backward, the AdamW step -- under torch's `FSDPMemTracker`
(`hflow.trainer.memory.trace`). What runs outside torch's view is written down as formulas:

- vLLM's engine: its weights (1/TP of the model in the rollout dtype) and one engine step's activations
  (the model's forward on max_num_batched_tokens tokens, traced the same way) inside the
  `gpu_memory_utilization` x device memory that vLLM takes on a GPU, the rest of which is KV cache
  (2 x layers x kv_heads x head_dim x bytes per token); on CPU the KV cache is `kv_cache_memory_bytes`
  (256 MiB when unset) and stays allocated (no sleep mode there);
- what each role keeps on the device while another phase runs (sharded parameters, optimizer state),
  which `param_offload` / `optimizer_offload` / `offload_policy` move to host memory (on a GPU only);
- the weight sync: FSDP shards all-gathered one parameter at a time (`iter_full_params`), so the largest
  full parameter and its cast to the rollout dtype beside the engine's weights;
- the distillation teacher (`teacher.model.path`): its own config's model, frozen in the compute dtype, its
  log-prob pass traced like the reference's, its shards kept between phases unless `param_offload`;
- constants for what neither torch nor a formula sees, printed as "assumed" (`ASSUMED`).

`trainer.memory_plan` in the config: `summary` (default) has preflight print one line, `enforce` refuses a
configuration whose plan does not fit (naming the phase and the keys), `off` skips it. Traces are cached
on disk (`$HFLOW_CACHE/memory_plan`) by everything they depend on, so a repeated configuration costs
milliseconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from hflow.trainer.memory.facts import (
    GIB,
    Role,
    cached,
    default_device_bytes,
    dtype_bytes,
    gather_once,
    gather_once_update,
    mixed_dtypes,
    model_config_text,
    model_numel,
    trace,
    traced_components,
)
from hflow.utils.errors import ConfigError

__all__ = ["ASSUMED", "Phase", "Plan", "Remedy", "check_memory_plan", "plan_memory", "remedies",
           "summary_line"]

# What the plan cannot count: each figure is printed beside the word "assumed".
ASSUMED = {
    # CUDA context, cuBLAS/cuDNN workspaces of one process (about 0.5-0.6 GiB on an H100 with torch 2.x)
    "cuda_context": 0.6 * GIB,
    # NCCL communicators: the training world's and the vLLM tensor-parallel group's buffers
    "nccl_buffers": 0.5 * GIB,
    # the caching allocator's rounding and fragmentation, as a share of the tensors' peak
    "allocator_slack": 0.10,
    # what a vLLM engine asleep at level 2 keeps on the device (CUDA graph pool, its own buffers)
    "vllm_asleep": 0.5 * GIB,
    # vLLM's own non-torch memory inside its gpu_memory_utilization budget (CUDA graphs, NCCL)
    "vllm_non_torch": 0.5 * GIB,
    # a CPU worker process's libraries (torch, transformers, vLLM): 0.63 GB measured in cpu-stack.md
    "cpu_process": 0.63e9,
}

# `vllm_rollout.CPU_DEFAULT_KV_CACHE_BYTES` (importing that module imports vLLM: seconds); a test checks they agree
CPU_DEFAULT_KV_CACHE_BYTES = 256 * 2**20
# `packing.SDPA_VARLEN` (that module imports transformers)
CPU_ATTENTION = "hflow_sdpa_varlen"


# ------------------------------------------------------------------------------------------------ plan


@dataclass
class Phase:
    name: str
    components: dict[str, float] = field(default_factory=dict)  # label -> bytes per rank
    note: str = ""
    problem: str = ""  # a reason the phase cannot run whatever the total (e.g. no room for a KV cache)
    spec: Any = None  # the traced pass (`memory_trace.PassSpec`), for the passes torch runs
    traced: float = 0.0  # that pass's peak as the tracker counted it (the rest is resident state or formulas)

    @property
    def total(self) -> float:
        return sum(self.components.values())


@dataclass
class Plan:
    phases: list[Phase]
    device_bytes: float
    target: str  # "cuda" | "cpu"
    world: int
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    def failing(self) -> list[Phase]:
        return [p for p in self.phases if p.total > self.device_bytes or p.problem]

    @property
    def fits(self) -> bool:
        return not self.failing()


@dataclass
class Remedy:
    overrides: dict[str, Any]
    phase: str  # the failing phase it addresses
    before: float
    after: float  # that phase's figure after the change
    peak_after: float
    fits: bool


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"




# ---------------------------------------------------------------------------------------------- the plan


def plan_memory(config: DictConfig, target: str | None = None, device_bytes: float | None = None) -> Plan:
    """The plan for `config` (composed and validated, model path filled in) on `target` ("cuda" or "cpu";
    None = this machine's device) with devices of `device_bytes` (None = `default_device_bytes`)."""
    from hflow.trainer.config import check_placement
    from hflow.utils import device
    from hflow.trainer.memory.trace import PassSpec
    from hflow.workers.rollout.config import GPU_MEMORY_UTILIZATION

    target = target or ("cuda" if device.is_cuda() else "cpu")
    device_bytes = float(device_bytes or default_device_bytes(config, target))
    cuda = target == "cuda"
    from hflow.workers.config import resolve_device_defaults, unresolved_device_keys

    if unresolved_device_keys(config):  # a caller that did not resolve them (the trainer and the CLI do): the rule alone
        config = config.copy()
        with open_dict(config):
            resolve_device_defaults(config.actor_rollout_ref, cuda, critic=config.get("critic"))
    data, arr, algo, trainer = config.data, config.actor_rollout_ref, config.algorithm, config.trainer
    actor, rollout, ref_cfg, model_cfg = arr.actor, arr.rollout, arr.ref, arr.model
    n, batch = int(rollout.n), int(data.train_batch_size)
    tp = int(rollout.tensor_model_parallel_size)
    world, rollout_world = check_placement(trainer, rollout.name, tp, batch, n)
    split = trainer.placement == "split"
    prompt, response = int(data.max_prompt_length), int(data.max_response_length)
    seq = prompt + response
    compute = "bfloat16" if cuda else "float32"
    rollout_dtype = str(rollout.dtype or compute)
    model_text = model_config_text(model_cfg)
    numel, largest, shape = model_numel(model_text)
    lora_rank = int(model_cfg.lora_rank or 0)
    lora = (lora_rank, float(model_cfg.lora_alpha), str(model_cfg.target_modules)) if lora_rank else None
    gae = algo.adv_estimator == "gae"
    uses_ref = bool(algo.use_kl_in_reward or actor.use_kl_loss)
    ref_in_actor = uses_ref and lora is not None
    on_device = cuda  # offload switches move state to host memory, which on CPU is the device itself

    def role(fsdp, kind: str, gc: bool, model_dtype: str | None, packed: bool, role_lora=None,
             train: bool = True, params: int | None = None) -> Role:
        param_dtype, reduce_dtype = mixed_dtypes(fsdp, target)
        mdt = str(model_dtype or "float32")
        host_policy = bool(fsdp.get("offload_policy")) and on_device
        return Role(kind, mdt, param_dtype, reduce_dtype, gc,
                     gather_once(fsdp.get("gather_once_per_pass"), params or numel, dtype_bytes(param_dtype or mdt),
                                  target, device_bytes),
                     bool(fsdp.reshard_after_forward),
                     (bool(fsdp.get("param_offload")) and on_device) or host_policy,
                     ((bool(fsdp.get("optimizer_offload")) and on_device) or host_policy) and train,
                     packed, role_lora,
                     train and gather_once_update(fsdp.get("gather_once_per_update"), numel,
                                                  dtype_bytes(param_dtype or mdt), dtype_bytes(reduce_dtype or mdt),
                                                  target, device_bytes))

    actor_role = role(actor.fsdp_config, "causal", bool(model_cfg.enable_gradient_checkpointing),
                      actor.fsdp_config.model_dtype, bool(model_cfg.use_remove_padding), lora)
    ref_role = role(ref_cfg.fsdp_config, "causal", False, compute, bool(model_cfg.use_remove_padding), train=False)
    # the distillation teacher: a model of its own (its own size), frozen, in the compute dtype
    teacher = config.teacher
    teacher_role = teacher_text = None
    if teacher.model.path is not None:
        teacher_text = model_config_text(teacher.model)
        teacher_numel = model_numel(teacher_text)[0]
        teacher_role = role(teacher.fsdp_config, "causal", False, compute, bool(teacher.model.use_remove_padding),
                            train=False, params=teacher_numel)
    critic_role = None
    if gae:
        critic = config.critic
        critic_role = role(critic.model.fsdp_config, "value", bool(critic.model.enable_gradient_checkpointing),
                           critic.model.fsdp_config.model_dtype, bool(critic.model.use_remove_padding))

    def trainable(r: Role) -> float:
        if r.lora is None:
            return numel
        return _lora_numel(model_text, r.lora)

    def sharded(r: Role, frozen: bool = False) -> dict[str, float]:
        """What `r` keeps on each rank between its phases."""
        out = {}
        if not r.params_offloaded:
            count = numel + (trainable(r) if r.lora is not None else 0)
            out["params (sharded)"] = count * dtype_bytes(r.model_dtype) / world
        if not frozen and not r.optimizer_offloaded:
            out["optimizer state (AdamW, sharded)"] = 2 * trainable(r) * dtype_bytes(r.model_dtype) / world
        return out

    def per_rank(prompts_key_value: int) -> int:
        return prompts_key_value * n // world

    def micro(count_key: Any, tokens_key: Any, dynamic: bool) -> int:
        if dynamic:
            return max(1, int(tokens_key) // seq)
        return max(1, int(count_key))

    def spec(r: Role, b: int, train: bool, micro_batches: int = 1, entropy: bool = False) -> PassSpec:
        return PassSpec(model=r.kind, model_config=model_text, world=world, batch=b, seq=seq, response=response,
                        train=train, micro_batches=micro_batches, model_dtype=r.model_dtype,
                        param_dtype=r.param_dtype, reduce_dtype=r.reduce_dtype,
                        gradient_checkpointing=r.gradient_checkpointing, gather_once=r.gather_once,
                        gather_once_update=r.gather_once_update and train,
                        reshard_after_forward=r.reshard_after_forward, packed=r.packed, entropy=entropy,
                        lora=r.lora, foreach_optimizer=cuda,
                        attn_implementation="sdpa" if cuda else CPU_ATTENTION)

    # --- what stays on a training rank while another phase runs
    overhead: dict[str, float] = {}
    if cuda:
        overhead["CUDA context (assumed)"] = ASSUMED["cuda_context"]
        overhead["NCCL buffers (assumed)"] = ASSUMED["nccl_buffers"]
    else:
        overhead["worker process (assumed)"] = ASSUMED["cpu_process"]
    resident: dict[str, dict[str, float]] = {"actor": {f"actor {k}": v for k, v in sharded(actor_role).items()}}
    if actor.ema.enable and not actor_role.params_offloaded:  # ParamEMA: an fp32 copy of the actor's shards
        resident["actor"]["actor EMA (fp32, sharded)"] = trainable(actor_role) * 4 / world
    if uses_ref and not ref_in_actor:
        resident["ref"] = {f"ref {k}": v for k, v in sharded(ref_role, frozen=True).items()}
    if critic_role is not None:
        resident["critic"] = {f"critic {k}": v for k, v in sharded(critic_role).items()}
    if teacher_role is not None and not teacher_role.params_offloaded:
        resident["teacher"] = {"teacher params (sharded)": teacher_numel * dtype_bytes(compute) / world}

    # --- the rollout engine (colocated: on every training rank; split: on the rollout pool's ranks)
    rollout_bytes = dtype_bytes(rollout_dtype)
    engine_weights = numel * rollout_bytes / tp
    kv_per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * rollout_bytes / tp
    engine_act = 0.0
    vllm = rollout.name == "vllm"
    if vllm:
        # vLLM's profiling step: max_num_batched_tokens tokens, as sequences of max_model_len
        max_len = int(rollout.max_model_len or seq)
        rows = max(1, int(rollout.max_num_batched_tokens) // max_len)
        engine_act = trace(PassSpec(model="causal", model_config=model_text, world=1, batch=rows, seq=max_len,
                                     response=0, model_dtype=rollout_dtype,
                                     logits_positions=min(int(rollout.max_num_seqs), rows * max_len),
                                     attn_implementation=CPU_ATTENTION)).get("Activation", 0)
    gmu = float(rollout.gpu_memory_utilization if rollout.gpu_memory_utilization is not None
                else GPU_MEMORY_UTILIZATION["own_device" if split else "colocated"])
    kv_bytes_setting = rollout.kv_cache_memory_bytes
    engine: dict[str, float] = {}
    problem = ""
    if vllm and cuda:
        engine = {"vLLM weights (1/TP)": engine_weights, "vLLM step activations": engine_act,
                  "vLLM non-torch (assumed)": ASSUMED["vllm_non_torch"]}
        if kv_bytes_setting is not None:
            engine["vLLM KV cache"] = float(kv_bytes_setting)
        else:
            kv = gmu * device_bytes - sum(engine.values())
            engine["vLLM KV cache"] = max(kv, 0.0)
            if kv <= 0:
                problem = (f"gpu_memory_utilization={gmu} x {_gib(device_bytes)} GiB leaves vLLM no KV cache after "
                           f"its weights and activations ({_gib(sum(engine.values()))} GiB)")
    elif vllm:
        engine = {"vLLM weights (1/TP)": engine_weights, "vLLM step activations": engine_act,
                  "vLLM KV cache": float(kv_bytes_setting or CPU_DEFAULT_KV_CACHE_BYTES)}
    kv_tokens = int(engine.get("vLLM KV cache", 0) // kv_per_token) if kv_per_token else 0
    sleeps = vllm and cuda and bool(rollout.free_cache_engine)
    if split or not vllm:
        engine_between: dict[str, float] = {}
    elif sleeps:
        engine_between = {"vLLM asleep (assumed)": ASSUMED["vllm_asleep"]}
    else:  # no sleep (CPU, or free_cache_engine=false): the engine keeps its weights and KV cache
        engine_between = {f"{k} (kept)": v for k, v in engine.items() if "activations" not in k}

    def others(*skip: str, optimizer_of: str | None = None) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, comps in resident.items():
            if name in skip:  # the pass's own model: the trace has its state, except what the pass never touches
                out.update({k: v for k, v in comps.items()
                            if "EMA" in k or (name == optimizer_of and "optimizer" in k)})
                continue
            out.update(comps)
        return out

    def slack(comps: dict[str, float]) -> dict[str, float]:
        if not cuda:
            return comps
        # torch's caching allocator: the trainer's tensors (vLLM allocates its weights and KV cache itself)
        tensors = sum(v for k, v in comps.items() if "assumed" not in k and not k.startswith("vLLM"))
        return {**comps, "allocator slack (assumed)": ASSUMED["allocator_slack"] * tensors}

    # a vision-language model: the worst case the prompt length allows, every prompt token an image token, in
    # images of the processor's largest size (`image_layout`); each pass's vision tower traced on them
    images = image_layout(model_cfg.path, model_text, prompt)

    phases: list[Phase] = []
    sequences = per_rank(batch)
    # 1. generation
    if vllm:
        comps = dict(engine)
        if not split:
            comps.update(others())
        comps.update(overhead)
        phases.append(Phase("rollout", slack(comps), problem=problem,
                            note=f"KV cache holds {kv_tokens} tokens; the batch needs up to "
                                 f"{batch * n * seq // max(1, rollout_world // tp)} per engine"))
        # 2. weight sync: one full parameter (model dtype) and its cast beside the engine's weights
        comps = {"vLLM weights (1/TP)": engine_weights}
        if not cuda:
            comps["vLLM KV cache"] = engine["vLLM KV cache"]
        comps.update({f"actor {k}": v for k, v in sharded(replace(actor_role, params_offloaded=False)).items()})
        comps.update(others("actor"))
        full_bytes = largest * dtype_bytes(actor_role.model_dtype)
        comps["gathered parameter (largest, model dtype)"] = full_bytes
        if actor_role.model_dtype != rollout_dtype:
            comps["its cast to the rollout dtype"] = largest * rollout_bytes
        if split:  # the training rank streams; the engine is elsewhere
            comps.pop("vLLM weights (1/TP)")
            comps.pop("vLLM KV cache", None)
        comps.update(overhead)
        phases.append(Phase("weight sync", slack(comps), note="one full parameter at a time (iter_full_params)"))
    else:
        engine_between = {}
    # 3. log-prob, value and update passes
    dyn = bool(actor.use_dynamic_bsz)
    forwards = []  # (phase, label, role, owner whose optimizer stays, micro count, token budget, dynamic, entropy)
    # reuse_update_log_probs still runs the pass at step 1 and every algorithm.rollout_check_freq steps
    if not algo.use_rollout_log_probs:
        forwards.append(("old log-prob", "actor", actor_role, "actor", rollout.log_prob_micro_batch_size_per_gpu,
                         rollout.log_prob_max_token_len_per_gpu, rollout.log_prob_use_dynamic_bsz, True))
    if uses_ref:
        label, owner = ("actor (adapters off)", "actor") if ref_in_actor else ("ref", "ref")
        forwards.append(("ref log-prob", label, actor_role if ref_in_actor else ref_role, owner,
                         ref_cfg.log_prob_micro_batch_size_per_gpu, ref_cfg.log_prob_max_token_len_per_gpu,
                         ref_cfg.log_prob_use_dynamic_bsz, False))
    if teacher_role is not None:
        forwards.append(("teacher log-prob", "teacher", teacher_role, "teacher", teacher.log_prob_micro_batch_size_per_gpu,
                         teacher.log_prob_max_token_len_per_gpu, teacher.log_prob_use_dynamic_bsz, False))
    if critic_role is not None:
        critic = config.critic
        forwards.append(("values", "critic", critic_role, "critic", critic.forward_micro_batch_size_per_gpu,
                         critic.forward_max_token_len_per_gpu, critic.use_dynamic_bsz, False))
    for name, label, r, owner, count, tokens, dynamic, entropy in forwards:
        b = min(micro(count, tokens, bool(dynamic)), sequences)
        pass_spec = spec(r, b, train=False, entropy=entropy)
        if r is teacher_role:  # the teacher's own architecture
            pass_spec = replace(pass_spec, model_config=teacher_text)
        peak = trace(pass_spec)
        comps = traced_components(peak, label)
        if r is not teacher_role:
            comps.update(vision_pass(pass_spec, label, images))
        comps.update(others(owner, optimizer_of=owner))
        comps.update(engine_between)
        comps.update(overhead)
        phases.append(Phase(name, slack(comps), note=f"micro-batch {b} x {seq} tokens", spec=pass_spec,
                            traced=peak["Total"]))
    updates = [("actor update", "actor", actor_role, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
                actor.ppo_max_token_len_per_gpu, dyn, float(actor.entropy_coeff) != 0)]
    if critic_role is not None:
        updates.append(("critic update", "critic", critic_role, config.critic.ppo_mini_batch_size,
                        config.critic.ppo_micro_batch_size_per_gpu, config.critic.ppo_max_token_len_per_gpu,
                        bool(config.critic.use_dynamic_bsz), False))
    for name, who, r, mini, micro_count, tokens, dynamic, entropy in updates:
        mini_rank = per_rank(int(mini))
        b = min(micro(micro_count, tokens, dynamic), mini_rank)
        accumulation = max(1, math.ceil(mini_rank / b))
        frozen = bool(images) and bool((config.critic if who == "critic" else actor).freeze_vision_tower)
        pass_spec = replace(spec(r, b, train=True, micro_batches=min(2, accumulation), entropy=entropy),
                            freeze_vision_tower=frozen)
        peak = trace(pass_spec)
        comps = traced_components(peak, who)
        comps.update(vision_pass(replace(pass_spec, train=not frozen), who, images))
        comps.update(others(who))
        comps.update(engine_between)
        comps.update(overhead)
        gc = "on" if r.gradient_checkpointing else "off"
        phases.append(Phase(name, slack(comps),
                            note=f"micro-batch {b} x {seq} tokens, {accumulation} per step; checkpointing {gc}",
                            spec=pass_spec, traced=peak["Total"]))
    facts = {"parameters": numel, "world": world, "rollout ranks": rollout_world, "tensor parallel": tp,
             "compute dtype": compute, "rollout dtype": rollout_dtype, "KV bytes per token": kv_per_token,
             "KV tokens": kv_tokens, "gpu_memory_utilization": gmu if cuda else None,
             "sequences per rank": sequences, "sequence length": seq}
    return Plan(phases, device_bytes, target, world, facts)


def image_layout(model_path: str, model_text: str, prompt_tokens: int) -> tuple[int, ...]:
    """A sequence's images in the worst case (merged tokens per image): `prompt_tokens` image tokens (the
    dataset counts them in `data.max_prompt_length`), in images of the processor's largest size (its
    `max_pixels`: `size.longest_edge` in `preprocessor_config.json`) and one of the rest; () for a text model."""
    from pathlib import Path

    vision = json.loads(model_text).get("vision_config")
    if vision is None:
        return ()
    pre_file = Path(str(model_path)).expanduser() / "preprocessor_config.json"
    pre = json.loads(pre_file.read_text()) if pre_file.is_file() else {}
    max_pixels = (pre.get("size") or {}).get("longest_edge") or pre.get("max_pixels")
    token_pixels = (int(vision.get("patch_size", 14)) * int(vision.get("spatial_merge_size", 2))) ** 2
    largest = max(1, int(max_pixels) // token_pixels) if max_pixels else prompt_tokens
    whole, rest = divmod(prompt_tokens, largest)
    return (largest,) * whole + ((rest,) if rest else ())


def vision_pass(pass_spec, label: str, images: tuple[int, ...]) -> dict[str, float]:
    """The vision tower's share of a pass on a vision-language model (`trace._run_vision`): what its forward
    (and backward, when it trains) holds on the micro-batch's images; {} for a text model."""
    if not images:
        return {}
    peak = trace(replace(pass_spec, image_tokens=images))
    model_state = ("Sharded Param", "Sharded Grad", "Buffer", "OptState", "Total")  # the pass's own trace has them
    held = sum(v for k, v in peak.items() if k not in model_state)
    return {f"{label} vision tower (activations, pixels)": float(held)}


def _lora_numel(model_text: str, lora: tuple) -> int:
    def compute() -> dict[str, int]:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from hflow.workers.fsdp.lora import add_lora

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(model_text)))
        model = add_lora(model, *lora)
        return {"numel": sum(p.numel() for p in model.parameters() if p.requires_grad)}

    return cached(f"lora:{list(lora)}:{model_text}", compute)["numel"]


# ------------------------------------------------------------------------------------------- remedies


def _candidates(config: DictConfig, plan: Plan, phase: Phase) -> list[dict[str, Any]]:
    """Changes that lower `phase`, cheapest first (each a dict of overrides)."""
    arr, critic = config.actor_rollout_ref, config.critic
    out: list[dict[str, Any]] = []
    name = phase.name

    def halvings(key: str, value: int) -> None:
        value = int(value)
        while value > 1:
            value //= 2
            out.append({key: value})

    if name == "actor update" and not arr.model.enable_gradient_checkpointing:
        out.append({"actor_rollout_ref.model.enable_gradient_checkpointing": True})
    if name == "critic update" and not critic.model.enable_gradient_checkpointing:
        out.append({"critic.model.enable_gradient_checkpointing": True})
    # per phase: (section, its dynamic-batch switch, token budget key, micro-batch key, FSDP section)
    sizes = {
        "actor update": ("actor_rollout_ref.actor", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
                         "ppo_micro_batch_size_per_gpu", None),
        "critic update": ("critic", "use_dynamic_bsz", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size_per_gpu",
                          None),
        "old log-prob": ("actor_rollout_ref.rollout", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu",
                         "log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.actor.fsdp_config"),
        "ref log-prob": ("actor_rollout_ref.ref", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu",
                         "log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.fsdp_config"),
        "teacher log-prob": ("teacher", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu",
                             "log_prob_micro_batch_size_per_gpu", "teacher.fsdp_config"),
        "values": ("critic", "use_dynamic_bsz", "forward_max_token_len_per_gpu", "forward_micro_batch_size_per_gpu",
                   "critic.model.fsdp_config"),
    }
    if name in sizes:
        section, dynamic, tokens, count, fsdp_section = sizes[name]
        key = f"{section}.{tokens if OmegaConf.select(config, f'{section}.{dynamic}') else count}"
        halvings(key, OmegaConf.select(config, key))
        if fsdp_section and OmegaConf.select(config, f"{fsdp_section}.gather_once_per_pass") is not False:
            out.append({f"{fsdp_section}.gather_once_per_pass": False})
    update_fsdp = {"actor update": "actor_rollout_ref.actor.fsdp_config", "critic update": "critic.model.fsdp_config"}
    if name in update_fsdp and OmegaConf.select(config, f"{update_fsdp[name]}.gather_once_per_update") is not False:
        out.append({f"{update_fsdp[name]}.gather_once_per_update": False})
    kv_setting = arr.rollout.kv_cache_memory_bytes
    if name == "rollout" and (plan.target == "cpu" or kv_setting is not None):
        kv = int(kv_setting or CPU_DEFAULT_KV_CACHE_BYTES)
        per_token = plan.facts.get("KV bytes per token") or 1
        while kv // 2 >= per_token * plan.facts.get("sequence length", 1):  # room for one sequence at least
            kv //= 2
            out.append({"actor_rollout_ref.rollout.kv_cache_memory_bytes": kv})
    if name == "rollout" and plan.target == "cuda" and kv_setting is None:
        gmu = plan.facts.get("gpu_memory_utilization") or 0.5
        for value in (0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2):
            if value < gmu:
                out.append({"actor_rollout_ref.rollout.gpu_memory_utilization": value})
    if plan.target == "cuda":  # offloading: state to host memory between phases
        fsdp = arr.actor.fsdp_config
        if not fsdp.optimizer_offload and name != "actor update":
            out.append({"actor_rollout_ref.actor.fsdp_config.optimizer_offload": True})
        if config.algorithm.use_kl_in_reward or arr.actor.use_kl_loss:
            if not arr.ref.fsdp_config.param_offload and name != "ref log-prob":
                out.append({"actor_rollout_ref.ref.fsdp_config.param_offload": True})
        if config.teacher.model.path is not None and not config.teacher.fsdp_config.param_offload \
                and name != "teacher log-prob":
            out.append({"teacher.fsdp_config.param_offload": True})
        if not fsdp.param_offload and name not in ("actor update", "old log-prob", "weight sync"):
            out.append({"actor_rollout_ref.actor.fsdp_config.param_offload": True})
        if name == "actor update" and not fsdp.offload_policy:
            out.append({"actor_rollout_ref.actor.fsdp_config.optimizer_offload": True})
        if config.algorithm.adv_estimator == "gae" and not critic.model.fsdp_config.optimizer_offload \
                and name != "critic update":
            out.append({"critic.model.fsdp_config.optimizer_offload": True})
            out.append({"critic.model.fsdp_config.param_offload": True})
    if name in ("rollout", "weight sync"):
        tp = int(arr.rollout.tensor_model_parallel_size)
        if plan.world % (2 * tp) == 0:
            out.append({"actor_rollout_ref.rollout.tensor_model_parallel_size": 2 * tp})
    return out


def _with(config: DictConfig, overrides: dict[str, Any]) -> DictConfig:
    changed = config.copy()
    with open_dict(changed):
        for key, value in overrides.items():
            OmegaConf.update(changed, key, value, merge=False)
    return changed


def remedies(config: DictConfig, plan: Plan, target: str | None = None) -> list[Remedy]:
    """For the first failing phase: each candidate change re-planned alone (for a micro-batch or token
    budget, the largest halving that makes the phase fit, else the smallest tried), in order of cost; when
    none makes the whole plan fit alone, the cheapest combination in the same order that does."""
    failing = plan.failing()
    if not failing:
        return []
    phase = failing[0]
    target = target or plan.target
    by_key: dict[str, Remedy] = {}
    for overrides in _candidates(config, plan, phase):
        (key, _), = overrides.items()
        if key in by_key and by_key[key].after <= plan.device_bytes:
            continue  # a smaller value than one that already makes the phase fit
        try:
            after = plan_memory(_with(config, overrides), target, plan.device_bytes)
        except ConfigError:  # e.g. a micro-batch that no longer divides the mini-batch
            continue
        same = next((p for p in after.phases if p.name == phase.name), None)
        figure = same.total if same is not None else 0.0
        if figure >= phase.total - 2**20:
            continue  # does not lower the phase
        figure_fits = figure <= plan.device_bytes and not (same is not None and same.problem)
        by_key[key] = Remedy(overrides, phase.name, phase.total, figure if figure_fits or same is None or
                             not same.problem else max(figure, plan.device_bytes + 1), after.peak.total, after.fits)
    found = list(by_key.values())
    if found and not any(r.fits for r in found):
        applied: dict[str, Any] = {}
        for r in found:
            applied.update(r.overrides)
            after = plan_memory(_with(config, applied), target, plan.device_bytes)
            if after.fits:
                figure = next((p.total for p in after.phases if p.name == phase.name), 0.0)
                found.append(Remedy(dict(applied), phase.name, phase.total, figure, after.peak.total, True))
                break
    return found


# --------------------------------------------------------------------------------------------- output


def format_plan(plan: Plan, found: list[Remedy] | None = None) -> str:
    device = "GPU" if plan.target == "cuda" else "CPU worker (host memory / workers per node)"
    lines = [f"memory plan per rank: {plan.world} training ranks, {device} of {_gib(plan.device_bytes)} GiB",
             "", "| phase | peak GiB | components (GiB) | note |", "|---|---:|---|---|"]
    for phase in plan.phases:
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(phase.components.items(), key=lambda kv: -kv[1])
                          if v >= 0.005 * GIB)
        mark = " **does not fit**" if phase in plan.failing() else ""
        note = "; ".join(x for x in (phase.note, phase.problem) if x)
        lines.append(f"| {phase.name}{mark} | {_gib(phase.total)} | {parts} | {note} |")
    lines += ["", "facts: " + ", ".join(f"{k} {v}" for k, v in plan.facts.items() if v is not None),
              "assumed (not counted, written down): " + ", ".join(
                  f"{k} {v if k == 'allocator_slack' else _gib(v) + ' GiB'}" for k, v in ASSUMED.items()
                  if (plan.target == "cuda") != (k == "cpu_process")), ""]
    lines.append(summary_line(plan))
    if found:
        lines += ["", f"keys that lower {found[0].phase} ({_gib(found[0].before)} GiB), cheapest first:"]
        for r in found:
            keys = " ".join(f"{k}={_value(v)}" for k, v in r.overrides.items())
            verdict = "fits" if r.fits else ("phase fits" if r.after <= plan.device_bytes else "not enough")
            lines.append(f"  {keys}  ->  {r.phase} {_gib(r.after)} GiB, peak {_gib(r.peak_after)} GiB ({verdict})")
    return "\n".join(lines)


def _value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def summary_line(plan: Plan) -> str:
    peak = plan.peak
    head = f"memory plan: peak {_gib(peak.total)} GiB/rank in {peak.name} (of {_gib(plan.device_bytes)} GiB)"
    failing = plan.failing()
    if not failing:
        return f"{head} — fits"
    worst = failing[0]
    why = worst.problem or f"{worst.name} needs {_gib(worst.total)} GiB"
    return f"{head} — does NOT fit: {why} (python -m hflow.cli.memory_plan <overrides> lists the keys to change)"


def check_memory_plan(config: DictConfig, mode: str) -> Plan | None:
    """Preflight: `summary` prints one line, `enforce` raises ConfigError naming the phase and the keys."""
    if mode == "off":
        return None
    try:
        plan = plan_memory(config)
    except (RuntimeError, ConfigError) as err:
        # torch.distributed already initialised in this process, a config.json transformers cannot build
        if mode == "enforce":
            raise ConfigError(f"trainer.memory_plan=enforce: the plan cannot be made: {err}") from None
        print(f"memory plan: skipped ({err})")
        return None
    if mode == "enforce" and not plan.fits:
        phase = plan.failing()[0]
        found = remedies(config, plan)
        fixes = "; ".join(" ".join(f"{k}={_value(v)}" for k, v in r.overrides.items())
                          + f" (-> {_gib(r.after)} GiB)" for r in found if r.fits) or \
            "; ".join(" ".join(f"{k}={_value(v)}" for k, v in r.overrides.items()) for r in found)
        why = phase.problem or f"needs {_gib(phase.total)} GiB per rank"
        raise ConfigError(f"memory plan: phase '{phase.name}' does not fit in {_gib(plan.device_bytes)} GiB: {why}. "
                          f"Change {fixes or 'the batch sizes or the number of devices'}; or set "
                          "trainer.memory_plan=summary to start anyway (python -m hflow.cli.memory_plan shows the table)")
    print(summary_line(plan))
    return plan
