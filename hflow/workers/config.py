"""The workers' config sections and their rules: what every model section shares (`optim`, `fsdp_config`,
`checkpoint`, the batch-size rules), `actor_rollout_ref` (model, actor, ref; the rollout section is
`hflow.workers.rollout.config`'s) with its per-rank normalisation, the reward model worker's, and DPO's
loss (`dpo`, a section of the DPO stage).
Typed defaults here; comments in `config/ppo_trainer.yaml`.

Batch sizes are given globally in prompts (`ppo_mini_batch_size`) and per device in sequences
(`*_micro_batch_size_per_gpu`). A worker of a group of `world_size` ranks trains on

    ppo_mini_batch_size_per_rank = ppo_mini_batch_size * rollout.n / world_size   sequences,

cut into micro-batches of `ppo_micro_batch_size_per_gpu`. The user's keys keep their values; derived
per-rank values get names of their own. Every impossible combination raises a `ConfigError` that names
the keys to change (the trainer's preflight applies the same functions before it starts Ray, with the
world size the trainer will use, so the two can never disagree).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from hflow.algorithms import core_algos
from hflow.algorithms.config import KL_TYPES, LOSS_AGG_MODES
from hflow.utils import device
from hflow.config_schema import (
    WORLD_KEYS,
    ConfigError,
    ConfigErrors,
    check_choice,
    check_fraction,
    check_non_negative,
    check_positive,
    check_positive_number,
    ref,
)
from hflow.workers.rollout.config import (
    WEIGHT_BUCKET_MB,
    RolloutConfig,
    check_admission,
    check_rollout_name,
    check_tensor_parallel,
    resolve_gpu_memory_utilization,
)

WARMUP_STYLES = ("constant", "cosine")  # hflow.workers.fsdp.build_lr_scheduler


# ==================================================================================================
# What every model section shares
# ==================================================================================================


@dataclass
class CheckpointConfig:
    contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])


@dataclass
class OptimConfig:
    lr: float = 1.0e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01
    lr_warmup_steps: int = -1  # negative = lr_warmup_steps_ratio x total steps
    lr_warmup_steps_ratio: float = 0.0
    warmup_style: str = "constant"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    total_training_steps: int = -1  # filled in by the trainer
    kernel: str = "auto"  # AdamW: auto (fused on GPU, foreach elsewhere) | fused | foreach


@dataclass
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    gather_once_per_pass: Optional[bool] = None  # None = by model size and device memory
    gather_once_per_update: Optional[bool] = None  # None = by model size and device memory
    model_dtype: Optional[str] = None
    mixed_precision: Optional[dict[str, Any]] = None


def check_optim(optim: Any, prefix: str) -> None:
    """An `optim` section that AdamW and the schedule accept (unchecked, a bad value fails in every worker
    after Ray started, as torch's "Invalid learning rate", or silently trains nothing at lr=0); all of its
    errors together."""
    errors = ConfigErrors()
    with errors.catch():
        if not float(optim.lr) > 0:
            raise ConfigError(f"{prefix}.lr must be > 0 (e.g. 1e-6), got {optim.lr}")
    with errors.catch():
        betas = list(optim.betas)
        if len(betas) != 2 or not all(0.0 <= float(beta) < 1.0 for beta in betas):
            raise ConfigError(f"{prefix}.betas must be two numbers in [0, 1) (e.g. [0.9, 0.999]), got {betas}")
    with errors.catch():
        if float(optim.weight_decay) < 0:
            raise ConfigError(f"{prefix}.weight_decay must be >= 0, got {optim.weight_decay}")
    errors.run(check_choice, optim.warmup_style, WARMUP_STYLES, f"{prefix}.warmup_style")
    for key in ("lr_warmup_steps_ratio", "min_lr_ratio"):
        with errors.catch():
            if not 0.0 <= float(optim[key]) <= 1.0:
                raise ConfigError(f"{prefix}.{key} must be in [0, 1], got {optim[key]}")
    errors.run(check_non_negative, optim.num_cycles, f"{prefix}.num_cycles", "cosine periods over the run")
    errors.run(check_choice, optim.kernel, device.OPTIMIZER_KERNELS, f"{prefix}.kernel")
    errors.raise_any()


def check_offload(fsdp_config: Any, prefix: str) -> None:
    """`offload_policy` (FSDP2's CPUOffloadPolicy: shards, gradients and optimizer step stay on the host)
    excludes the per-phase switches, which move the same state to the device and back around each call."""
    if not fsdp_config.offload_policy:
        return
    clashing = [f"{prefix}.{key}" for key in ("param_offload", "optimizer_offload") if fsdp_config.get(key)]
    if clashing:
        raise ConfigError(
            f"{prefix}.offload_policy=true cannot be combined with {' and '.join(clashing)}=true: the policy "
            "already keeps that state on the host; set one of them to false")


def check_train_batch(batch_prompts: int, n: int, world_size: int) -> None:
    """A training batch of `data.train_batch_size` prompts x `rollout.n` samples splits evenly over the ranks."""
    if batch_prompts < 1:
        raise ConfigError(f"data.train_batch_size must be >= 1, got {batch_prompts}")
    if batch_prompts * n % world_size:
        raise ConfigError(
            f"data.train_batch_size ({batch_prompts}) x actor_rollout_ref.rollout.n ({n}) = {batch_prompts * n} "
            f"sequences cannot be split evenly over {world_size} ranks ({WORLD_KEYS})")


def check_mini_batch(mini_batch_prompts: int, batch_prompts: int, prefix: str) -> None:
    """`<prefix>.ppo_mini_batch_size` prompts cut the training batch into whole mini-batches."""
    check_positive(mini_batch_prompts, f"{prefix}.ppo_mini_batch_size")  # before dividing by it
    if mini_batch_prompts > batch_prompts:
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size ({mini_batch_prompts}) is larger than data.train_batch_size "
            f"({batch_prompts}); it counts prompts of one batch")
    if batch_prompts % mini_batch_prompts:
        raise ConfigError(
            f"data.train_batch_size ({batch_prompts}) must be a multiple of {prefix}.ppo_mini_batch_size "
            f"({mini_batch_prompts})")


def per_rank_mini_batch(mini_batch_prompts: int, n: int, world_size: int, prefix: str, n_key: str) -> int:
    """Sequences per rank in one optimizer step: ppo_mini_batch_size x n / ranks."""
    if mini_batch_prompts is None or mini_batch_prompts <= 0:
        raise ConfigError(f"{prefix}.ppo_mini_batch_size must be a positive number of prompts, got {mini_batch_prompts}")
    sequences = mini_batch_prompts * n
    if sequences % world_size:
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size ({mini_batch_prompts}) x {n_key} ({n}) = {sequences} sequences "
            f"cannot be split evenly over {world_size} ranks ({WORLD_KEYS}); make it a multiple of {world_size}")
    return sequences // world_size


def check_micro_batch(per_rank_mini: int, micro: Any, prefix: str, key: str, use_dynamic_bsz: bool) -> None:
    """Micro-batches of `<prefix>.<key>` sequences cut the per-rank mini-batch evenly (unless cut by tokens)."""
    if use_dynamic_bsz:
        return
    if micro is None or int(micro) <= 0:
        raise ConfigError(f"{prefix}.{key} must be a positive number of sequences (or set {prefix}.use_dynamic_bsz)")
    if per_rank_mini % int(micro):
        raise ConfigError(
            f"{prefix}.{key} ({micro}) must divide the per-rank mini-batch of {per_rank_mini} sequences "
            f"({prefix}.ppo_mini_batch_size x rollout.n / ranks); change one of them")


def check_update_batches(section: Any, batch_prompts: int, n: int, world_size: int, prefix: str, n_key: str) -> None:
    """A trained model's (`actor`, `critic`) mini- and micro-batches against the training batch and the ranks."""
    check_mini_batch(section.ppo_mini_batch_size, batch_prompts, prefix)
    per_rank = per_rank_mini_batch(section.ppo_mini_batch_size, n, world_size, prefix, n_key)
    check_micro_batch(per_rank, section.ppo_micro_batch_size_per_gpu, prefix, "ppo_micro_batch_size_per_gpu",
                      section.use_dynamic_bsz)


# ==================================================================================================
# actor_rollout_ref: the policy's model, its actor and its reference (the rollout: hflow.workers.rollout.config)
# ==================================================================================================


@dataclass
class ModelConfig:
    path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    override_config: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    attn_implementation: Optional[str] = None
    use_remove_padding: Optional[bool] = None  # actor/ref forwards on the valid tokens packed into one row; None = by device
    use_liger: bool = False  # Liger-Kernel RMSNorm/rotary/SwiGLU (hflow.workers.fsdp.kernels)
    use_torch_compile: bool = False  # torch.compile per decoder layer
    batch_invariant: bool = ref("trainer.deterministic")  # actor/ref products on fixed tiles (utils.batch_invariant)
    lora_rank: int = 0  # LoRA (PEFT) adapters of this rank on the actor; 0 = train every weight
    lora_alpha: float = 16.0  # LoRA scaling is lora_alpha / lora_rank
    target_modules: Any = "all-linear"  # the linears that get adapters: "all-linear" or a list of module names
    fused_lm_head: bool = False  # actor/ref: LM head + log-prob + entropy in one blocked pass, no full logits
    logit_block_elements: Optional[int] = None  # logits per block of the log-prob/entropy passes; None = device's


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    # cispo: the importance weight sg(rho) is clipped to [1 - low, 1 + high]; low null = no lower bound
    cispo_clip_ratio_low: Optional[float] = None
    cispo_clip_ratio_high: float = 0.28
    tau_pos: float = 1.0  # sapo: the gate's temperature on tokens with A > 0
    tau_neg: float = 1.05  # sapo: ... with A <= 0 (SAPO damps them harder: tau_neg > tau_pos)


@dataclass
class PtxConfig:
    coef: float = 0.0  # PPO-ptx weight of the pre-training LM loss; 0 = off
    files: Any = ref("data.ptx_files")
    text_key: str = ref("data.ptx_text_key")
    batch_size_per_gpu: int = 8  # texts each rank adds to every optimizer step
    micro_batch_size_per_gpu: int = 8  # texts per forward/backward
    max_length: int = 512  # tokens per text
    seed: int = ref("data.seed")


@dataclass
class EMAConfig:
    enable: bool = False  # an EMA of the actor's weights, checkpointed and exported
    decay: float = 0.992


@dataclass
class ActorConfig:
    strategy: str = "fsdp2"
    freeze_vision_tower: bool = False
    ppo_mini_batch_size: int = 16  # prompts per optimizer step (global)
    ppo_micro_batch_size_per_gpu: int = 8  # sequences per forward/backward on one device
    use_dynamic_bsz: Optional[bool] = None  # None = by device (`resolve_device_defaults`)
    ppo_max_token_len_per_gpu: Optional[int] = None  # None = by device and the memory plan
    ppo_epochs: int = 1
    shuffle: bool = True
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    router_replay: bool = False  # MoE: the sampler records each token's experts and the actor's forwards use them (R3)
    router_aux_loss_coef: Optional[float] = None  # MoE load-balancing loss weight; null = the model's, 0 = off
    ptx: PtxConfig = field(default_factory=PtxConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RefFSDPConfig:
    param_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    gather_once_per_pass: Optional[bool] = None  # None = by model size and device memory


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_use_dynamic_bsz: Optional[bool] = ref("actor_rollout_ref.actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: Optional[int] = ref("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


def check_model_kernels(model: Any, prefix: str) -> None:
    """`logit_block_elements`: null or a positive count of logits."""
    if model.get("logit_block_elements") is not None:
        check_positive(model.logit_block_elements, f"{prefix}.logit_block_elements")


def check_actor_ranges(actor: Any) -> None:
    """The actor's loss settings in range: clip ratios > 0 (the dual clip's c > 1), the gradient norm
    clip > 0, the KL and entropy coefficients >= 0; all of their errors together."""
    prefix = "actor_rollout_ref.actor"
    errors = ConfigErrors()
    errors.run(check_positive_number, actor.grad_clip, f"{prefix}.grad_clip", "the largest gradient norm")
    errors.run(check_positive_number, actor.clip_ratio, f"{prefix}.clip_ratio", "PPO's clip range, e.g. 0.2")
    for key in ("clip_ratio_low", "clip_ratio_high"):
        errors.run(check_positive_number, actor[key], f"{prefix}.{key}", "null: clip_ratio", null_ok=True)
    with errors.catch():
        if not float(actor.clip_ratio_c) > 1:
            raise ConfigError(f"{prefix}.clip_ratio_c must be > 1 (the dual clip's lower bound on negative "
                              f"advantages, e.g. 3), got {actor.clip_ratio_c}")
    loss = actor.policy_loss
    errors.run(check_fraction, loss.cispo_clip_ratio_low, f"{prefix}.policy_loss.cispo_clip_ratio_low",
               "the CISPO weight's lower bound is 1 - low; null: no lower bound", null_ok=True)
    errors.run(check_positive_number, loss.cispo_clip_ratio_high, f"{prefix}.policy_loss.cispo_clip_ratio_high",
               "the CISPO weight's upper bound is 1 + high, e.g. 0.28")
    for key in ("tau_pos", "tau_neg"):
        errors.run(check_positive_number, loss[key], f"{prefix}.policy_loss.{key}", "the SAPO gate's temperature, e.g. 1.0")
    errors.run(check_non_negative, actor.kl_loss_coef, f"{prefix}.kl_loss_coef")
    errors.run(check_non_negative, actor.entropy_coeff, f"{prefix}.entropy_coeff", "0: no entropy bonus")
    errors.run(check_non_negative, actor.router_aux_loss_coef, f"{prefix}.router_aux_loss_coef",
               "null: the model's router_aux_loss_coef, 0: off", null_ok=True)
    errors.raise_any()


def check_actor_losses(actor: Any) -> None:
    """`actor.loss_agg_mode`, `.policy_loss.loss_mode` and (with `use_kl_loss`) `.kl_loss_type`: names the
    algorithms know."""
    check_choice(actor.loss_agg_mode, LOSS_AGG_MODES, "actor_rollout_ref.actor.loss_agg_mode")
    try:
        core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
    except (KeyError, ValueError) as err:
        raise ConfigError(f"actor_rollout_ref.actor.policy_loss.loss_mode: {err}") from None
    if actor.use_kl_loss:
        check_choice(actor.kl_loss_type.removesuffix("+"), KL_TYPES, "actor_rollout_ref.actor.kl_loss_type")


# ---- keys whose null means "by the device": token-budget micro-batches on a GPU, the old behaviour on CPU ----

CPU_TOKEN_BUDGET = 16384  # ppo_max_token_len_per_gpu=null on CPU, and on a GPU when no memory plan chose one
# The budgets a GPU tries, largest first; the first whose update and log-prob passes the memory plan fits wins
# (24576 is what verl's examples use most; >= 16k tokens amortise the per-layer host cost of a micro-batch).
GPU_TOKEN_BUDGETS = (24576, 16384, 8192)


def resolve_device_defaults(arr: Any, cuda: bool, token_budget: int | None = None,
                            critic: Any = None) -> list[str]:
    """Fill, in place, the keys of `actor_rollout_ref` (and `critic`) left null ("by the device"): on a GPU
    remove-padding and token-budget micro-batches of `token_budget` tokens (the memory plan's choice; None:
    CPU_TOKEN_BUDGET), on CPU neither, with CPU_TOKEN_BUDGET. Keys that follow these (the log-prob budgets,
    the critic's switches) get the same values where they are null. Returns one "key=value" per key filled,
    for the line the trainer prints at start. The driver calls it once with the memory plan's budget
    (`hflow.trainer.memory.defaults`); a worker calls it again for whatever a caller of its own left null."""
    notes: list[str] = []

    def fill(section: Any, key: str, value: Any, prefix: str) -> Any:
        if section.get(key) is None:
            section[key] = value
            notes.append(f"{prefix}.{key}={str(value).lower() if isinstance(value, bool) else value}")
        return section[key]

    budget = int(token_budget) if cuda and token_budget else CPU_TOKEN_BUDGET
    fill(arr.model, "use_remove_padding", bool(cuda), "actor_rollout_ref.model")
    dynamic = fill(arr.actor, "use_dynamic_bsz", bool(cuda), "actor_rollout_ref.actor")
    tokens = fill(arr.actor, "ppo_max_token_len_per_gpu", budget, "actor_rollout_ref.actor")
    for name in ("rollout", "ref"):
        section = arr.get(name)
        if section is not None:  # interpolations already resolved (a worker's copy): the followers are null too
            fill(section, "log_prob_use_dynamic_bsz", dynamic, f"actor_rollout_ref.{name}")
            fill(section, "log_prob_max_token_len_per_gpu", tokens, f"actor_rollout_ref.{name}")
    if arr.get("rollout") is not None:
        fill(arr.rollout, "weight_bucket_mb", WEIGHT_BUCKET_MB["cuda" if cuda else "cpu"], "actor_rollout_ref.rollout")
    if critic is not None:
        fill(critic.model, "use_remove_padding", bool(arr.model.use_remove_padding), "critic.model")
        fill(critic, "use_dynamic_bsz", dynamic, "critic")
    return notes


LIGER_PACKAGE = "liger-kernel"  # the distribution of `model.use_liger` (`pip install -e '.[liger]'`)


def check_kernel_options(model_cfg: Any, prefix: str, cuda: bool | None = None) -> None:
    """Preflight: `<prefix>.use_liger` needs the liger-kernel package and a CUDA device (its kernels are Triton),
    and not `use_torch_compile` as well."""
    if not model_cfg.get("use_liger"):
        return
    if model_cfg.get("use_torch_compile"):
        # Measured on an H100 (torch 2.11, liger-kernel 0.8.5): TorchDynamo fails on Liger's Triton autograd
        # functions inside a compiled layer (bench/results/actor_speed_h100, arm H7).
        raise ConfigError(f"{prefix}.use_liger=true and {prefix}.use_torch_compile=true cannot be combined: "
                          "torch.compile cannot trace Liger's kernels inside the compiled decoder layers. Choose "
                          f"one: {prefix}.use_torch_compile=true alone fuses the same kernels (and was the faster "
                          "on an H100, bench/results/actor_speed_h100), or set it false to keep Liger")
    import importlib.util

    if cuda is None:
        from hflow.utils.device import is_cuda

        cuda = is_cuda()
    missing = []
    if importlib.util.find_spec("liger_kernel") is None:
        missing.append(f"the {LIGER_PACKAGE} package is not installed (pip install -e '.[liger]')")
    if not cuda:
        missing.append("there is no CUDA device (Liger's kernels are Triton GPU kernels)")
    if missing:
        raise ConfigError(f"{prefix}.use_liger=true but {' and '.join(missing)}; set {prefix}.use_liger=false "
                          f"(or {prefix}.use_torch_compile=true, which works on any device)")


def unresolved_device_keys(config: Any) -> list[str]:
    """The "by the device" keys of a trainer config still null."""
    keys = ["actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.actor.use_dynamic_bsz",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]
    return [k for k in keys if OmegaConf.select(config, k) is None]


def resolved_copy(config: Any) -> DictConfig:
    """A detached, fully resolved copy that the worker may extend with derived values."""
    if isinstance(config, DictConfig):
        return OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    return OmegaConf.create(copy.deepcopy(dict(config)))


def check_model_path(path: Any, key: str) -> None:
    """A local Hugging Face model folder (config.json and weights)."""
    if path is None:
        raise ConfigError(f"{key} is not set; give a local Hugging Face model folder")
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{key}={path} is not a folder; give a local Hugging Face model folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{key}={path} has no config.json; it is not a Hugging Face model folder")
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{key}={path}: its config.json is not readable JSON ({err}); restore the file") from None
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ConfigError(f"{key}={path} has no weights (*.safetensors or *.bin)")


# Any of these makes a folder a tokenizer's; without one, transformers builds an empty tokenizer of the
# model's type from config.json alone (no vocabulary, no chat template) instead of failing.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def check_tokenizer_path(model: Any, prefix: str) -> None:
    """The tokenizer folder of a model section (`tokenizer_path`, else `path`) holds a tokenizer."""
    key = f"{prefix}.tokenizer_path" if model.tokenizer_path else f"{prefix}.path"
    path = model.tokenizer_path or model.path
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{key}={path} is not a folder; give a local folder with the tokenizer's files")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        hint = "" if model.tokenizer_path else f", or set {prefix}.tokenizer_path to a folder that has them"
        raise ConfigError(f"{key}={path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
                          f"tokenizer's files there{hint}")


def normalize_actor_rollout_ref(config: DictConfig, role: str, world_size: int, own_device: bool = False) -> DictConfig:
    """Check the `actor_rollout_ref` subtree for `role` and turn global batch sizes into per-rank ones.
    `own_device`: the rollout engine has its devices to itself (a standalone engine of the rollout pool)."""
    cfg = resolved_copy(config)
    prefix = "actor_rollout_ref"
    from hflow.utils.device import is_cuda

    resolve_device_defaults(cfg, is_cuda())  # null left by a caller that is not the trainer (which resolves them)
    check_model_path(cfg.model.path, f"{prefix}.model.path")
    n = int(cfg.rollout.n)
    if n < 1:
        raise ConfigError(f"{prefix}.rollout.n must be >= 1, got {n}")
    if role in ("actor", "actor_rollout", "actor_rollout_ref"):
        actor = cfg.actor
        actor.ppo_mini_batch_size_per_rank = per_rank_mini_batch(
            actor.ppo_mini_batch_size, n, world_size, f"{prefix}.actor", f"{prefix}.rollout.n")
        check_micro_batch(actor.ppo_mini_batch_size_per_rank, actor.ppo_micro_batch_size_per_gpu, f"{prefix}.actor",
                          "ppo_micro_batch_size_per_gpu", actor.use_dynamic_bsz)
        check_positive(actor.ppo_epochs, f"{prefix}.actor.ppo_epochs")
        check_ptx(actor.ptx, f"{prefix}.actor.ptx")
        check_ema(actor.ema, f"{prefix}.actor.ema")
        check_lora(cfg, prefix)
    if cfg.rollout.dtype is None:  # the engine's dtype, and the weight stream's (fp16 on GPUs without bf16)
        from hflow.utils.device import rollout_dtype

        cfg.rollout.dtype = str(rollout_dtype()).removeprefix("torch.")
    cfg.rollout.gpu_memory_utilization = resolve_gpu_memory_utilization(
        cfg.rollout.gpu_memory_utilization, own_device, f"{prefix}.rollout.gpu_memory_utilization")
    if role in ("rollout", "actor_rollout", "actor_rollout_ref"):
        check_tensor_parallel(int(cfg.rollout.tensor_model_parallel_size), world_size)
        check_rollout_name(cfg.rollout.name)
        check_admission(cfg.rollout)
        if not cfg.rollout.log_prob_use_dynamic_bsz:
            check_positive(cfg.rollout.log_prob_micro_batch_size_per_gpu,
                           f"{prefix}.rollout.log_prob_micro_batch_size_per_gpu")
    if role in ("ref", "actor_rollout_ref") and not cfg.ref.log_prob_use_dynamic_bsz:
        check_positive(cfg.ref.log_prob_micro_batch_size_per_gpu, f"{prefix}.ref.log_prob_micro_batch_size_per_gpu")
    if role != "ref":  # every other role builds the actor's model
        check_offload(cfg.actor.fsdp_config, f"{prefix}.actor.fsdp_config")
    # The model-level flag, where DataParallelPPOActor reads it (the actor and the reference share it).
    cfg.actor.use_remove_padding = cfg.ref.use_remove_padding = bool(cfg.model.use_remove_padding)
    # The sampler records each token's experts when the actor replays them (`hflow.workers.moe`).
    cfg.rollout.record_routing = bool(cfg.actor.router_replay)
    check_model_kernels(cfg.model, f"{prefix}.model")
    cfg.actor.fused_lm_head = cfg.ref.fused_lm_head = bool(cfg.model.fused_lm_head)
    cfg.actor.logit_block_elements = cfg.ref.logit_block_elements = cfg.model.logit_block_elements
    if role in ("ref", "actor_rollout_ref"):
        check_offload(cfg.ref.fsdp_config, f"{prefix}.ref.fsdp_config")
    return cfg


def check_ptx(ptx: Any, prefix: str) -> None:
    """PPO-ptx sizes, when it is on (`coef > 0`); the files are checked where they are read."""
    coef = float(ptx.coef)
    if coef < 0:
        raise ConfigError(f"{prefix}.coef must be >= 0 (0 = off), got {coef}")
    if coef == 0:
        return
    check_positive(ptx.batch_size_per_gpu, f"{prefix}.batch_size_per_gpu")
    check_positive(ptx.micro_batch_size_per_gpu, f"{prefix}.micro_batch_size_per_gpu")
    if int(ptx.batch_size_per_gpu) % int(ptx.micro_batch_size_per_gpu):
        raise ConfigError(f"{prefix}.micro_batch_size_per_gpu ({ptx.micro_batch_size_per_gpu}) must divide "
                          f"{prefix}.batch_size_per_gpu ({ptx.batch_size_per_gpu})")
    if int(ptx.max_length) < 2:
        raise ConfigError(f"{prefix}.max_length must be >= 2 tokens (one predicts the next), got {ptx.max_length}")


def check_lora(arr: Any, prefix: str) -> None:
    """`model.lora_rank` is 0 (off) or positive, with an alpha and targets; the EMA of the weights is not
    kept for adapters."""
    model = arr.model
    rank = int(model.lora_rank)
    if rank < 0:
        raise ConfigError(f"{prefix}.model.lora_rank must be >= 0 (0 = no LoRA), got {rank}")
    if rank == 0:
        return
    if float(model.lora_alpha) <= 0:
        raise ConfigError(f"{prefix}.model.lora_alpha must be > 0, got {model.lora_alpha}")
    if not model.target_modules:
        raise ConfigError(f"{prefix}.model.target_modules is empty; use all-linear or a list of module names")
    if arr.actor.ema.enable:
        raise ConfigError(f"{prefix}.actor.ema.enable=true is not supported with {prefix}.model.lora_rank > 0")


def check_ema(ema: Any, prefix: str) -> None:
    if ema.enable and not 0.0 <= float(ema.decay) < 1.0:
        raise ConfigError(f"{prefix}.decay must be in [0, 1), got {ema.decay}")


def normalize_reward_model(config: DictConfig) -> DictConfig:
    cfg = resolved_copy(config)
    check_model_path(cfg.model.path, "reward_model.model.path")
    check_positive(cfg.micro_batch_size_per_gpu, "reward_model.micro_batch_size_per_gpu")
    return cfg


# ==================================================================================================
# DPO's loss (the `dpo` section of config/dpo_trainer.yaml; the loss: supervised_workers.dpo_loss)
# ==================================================================================================

DPO_LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class DPOConfig:
    beta: float = 0.1  # how far from the reference the policy may move: rewards are beta x log-ratios
    loss_type: str = "sigmoid"  # sigmoid (DPO; with label_smoothing: cDPO) | ipo
    label_smoothing: float = 0.0  # cDPO: the assumed share of flipped labels, in [0, 0.5); sigmoid only


def check_dpo(dpo: Any) -> None:
    """`dpo.beta` > 0, a known loss, label smoothing in [0, 0.5) and only where the loss reads it."""
    errors = ConfigErrors()
    errors.run(check_positive_number, dpo.beta, "dpo.beta", "the strength of the pull towards the reference")
    errors.run(check_choice, dpo.loss_type, DPO_LOSS_TYPES, "dpo.loss_type")
    with errors.catch():
        smoothing = float(dpo.label_smoothing)
        if not 0.0 <= smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5) (the assumed share of flipped labels; 0.5 "
                              f"would make every pair a coin flip), got {dpo.label_smoothing}")
        if smoothing and dpo.loss_type != "sigmoid":
            raise ConfigError(f"dpo.label_smoothing={dpo.label_smoothing} is cDPO's, a form of the sigmoid loss; "
                              f"dpo.loss_type={dpo.loss_type} does not read it: set it to 0 or use loss_type=sigmoid")
    errors.raise_any()
