"""Count the device memory of one training or inference pass with torch's memory tracker.

A pass (`PassSpec`: old/reference log-probs, values, an actor or critic update, one vLLM-sized forward)
runs the hflow code path it describes: the model built from its Hugging Face config, sharded by
`fsdp.apply_fsdp2` with the pass's mixed precision, gradient checkpointing and gathering, the
actor's `_forward_micro_batch` (logits of the response positions only, block-wise log-probs and entropy)
or the critic's value slice, backward per micro-batch and the AdamW step. `FSDPMemTracker`
(`torch.distributed._tools`) counts every tensor the pass holds on the rank, by category (sharded and
unsharded parameters, gradients, optimizer state, activations, temporaries, collective buffers); a model
that `apply_fsdp2` left unsharded (one rank, nothing to cast) is counted by its parent, `MemTracker`.

`trace_fake` runs it on fake tensors (`FakeTensorMode`: shapes and dtypes, no storage, no arithmetic) in
a fake process group of the pass's world size (`FakeStore`), so one process counts what each of W ranks
holds, for any model, from its config alone. `count_real_pass` runs the real worker code (the actor's and
critic's own methods) on real weights in a real process group under the same tracker: the CPU check of
`bench/memory_plan.py` and of the tests.

Shapes are the worst case the configuration allows: every sequence is prompt_length + response_length
tokens, all valid (with remove-padding, one packed row of micro_batch x that many tokens).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

__all__ = ["CATEGORIES", "PassSpec", "count_real_pass", "repeated_forwards", "trace_fake"]

# FSDPMemTracker's categories, shortened for tables
CATEGORIES = {
    "Sharded Param": "params (sharded)",
    "Unsharded Param": "params (gathered)",
    "Buffer": "buffers",
    "Sharded Grad": "grads (sharded)",
    "Unsharded Grad": "grads (gathered)",
    "Activation": "activations",
    "Temp": "backward temporaries",
    "All Gather": "all-gather buffers",
    "Reduce Scatter": "reduce-scatter buffers",
    "OptState": "optimizer state",
    "Inputs": "inputs",
    "Parameter": "params",
    "Gradient": "grads",
    "Other": "other",
}


@dataclass(frozen=True)
class PassSpec:
    """One pass on one rank. `batch` sequences of `seq` tokens, the last `response` scored."""

    model: str  # "causal" | "value"
    model_config: str  # the model's config.json text (with the run's override_config applied)
    world: int
    batch: int
    seq: int
    response: int
    train: bool = False
    micro_batches: int = 1  # backward passes before the optimizer step (gradient accumulation)
    model_dtype: str = "float32"  # dtype the (sharded) parameters are stored in
    param_dtype: str | None = None  # FSDP2 mixed precision: compute dtype; None = model_dtype
    reduce_dtype: str | None = None
    gradient_checkpointing: bool = False
    gather_once: bool = False  # no-grad pass: keep every unit gathered for the whole pass
    gather_once_update: bool = False  # update: keep every unit gathered, gradients unsharded, until the last backward
    reshard_after_forward: bool = True
    packed: bool = False  # use_remove_padding: one row of batch x seq valid tokens
    entropy: bool = False
    temperature: float = 1.0
    lora: tuple[int, float, str] | None = None  # (rank, alpha, target_modules)
    foreach_optimizer: bool = False  # AdamW's multi-tensor path (the default for CUDA tensors)
    attn_implementation: str = "sdpa"
    logits_positions: int | None = None  # no-grad full forward keeping this many positions' logits (rollout)
    # a vision-language model's vision tower on `batch` sequences' images, each (merged tokens per image, ...):
    # traced alone (`_run_vision`) when set
    image_tokens: tuple[int, ...] = ()
    freeze_vision_tower: bool = False  # the tower takes no gradient (actor / critic `freeze_vision_tower`)

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _build(spec: PassSpec) -> nn.Module:
    """The pass's model from its config, unsharded (fake tensors under FakeTensorMode)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, \
        AutoModelForTokenClassification

    import hflow.utils.packing  # noqa: F401 - registers SDPA_VARLEN

    raw = json.loads(spec.model_config)
    config = AutoConfig.for_model(**raw)
    if spec.model == "value":
        config.num_labels, config.classifier_dropout = 1, 0.0
    # a vision-language policy (and critic) as the workers load it; its tower runs in the pass on one small
    # image (`_ImageEncoding`), its activations on the run's images are `_run_vision`'s
    vision = hasattr(config, "vision_config")
    policy = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    auto = AutoModelForTokenClassification if spec.model == "value" else policy
    if vision and spec.model == "value":
        from hflow.workers.fsdp import register_vision_value_model

        register_vision_value_model(config)
    kwargs = dict(dtype=_dtype(spec.model_dtype), attn_implementation=spec.attn_implementation)
    model = auto.from_config(config, **kwargs)
    if vision and spec.freeze_vision_tower:  # as the workers do, before the optimizer
        from hflow.utils.vision import freeze_vision_tower

        freeze_vision_tower(model)
    if spec.lora is not None:
        from hflow.workers.fsdp.lora import add_lora

        rank, alpha, targets = spec.lora
        model = add_lora(model, rank, alpha, targets)
    return model


def _shard(model: nn.Module, spec: PassSpec, mesh) -> nn.Module:
    from hflow.workers import fsdp

    if spec.gradient_checkpointing and spec.train:
        fsdp.enable_gradient_checkpointing(model)
    mixed = None
    if spec.param_dtype is not None:
        mixed = {"param_dtype": spec.param_dtype, "reduce_dtype": spec.reduce_dtype or "float32"}
    fp32_modules = [model.score] if spec.model == "value" else []
    fsdp.apply_fsdp2(model, mesh, mixed_precision=mixed or {}, reshard_after_forward=spec.reshard_after_forward,
                           gather_once_per_pass=spec.gather_once, fp32_modules=fp32_modules,
                           gather_once_per_update=spec.gather_once_update)
    if not spec.train:
        model.requires_grad_(False)
    return model


def _micro_batch(spec: PassSpec, vocab: int) -> dict[str, Any]:
    b, t, length = spec.batch, spec.seq, spec.response
    ids = torch.zeros((b, t), dtype=torch.long)
    return {"input_ids": ids, "responses": ids[:, t - length:].clone(),
            "attention_mask": torch.ones((b, t), dtype=torch.long),
            "position_ids": torch.arange(t).expand(b, t).clone(),
            "advantages": torch.zeros((b, length)), "vocab": vocab}


def _packed(spec: PassSpec, mb: dict[str, Any]):
    """What `pack_micro_batch` returns for a micro-batch whose every token is valid, built without reading
    any tensor (fake tensors have no values)."""
    from hflow.utils.packing import PackedMicroBatch

    b, t, length = spec.batch, spec.seq, spec.response
    bounds = tuple(i * t for i in range(b + 1))
    scoring = torch.cat([torch.arange(i * t + t - length - 1, i * t + t - 1) for i in range(b)])
    return PackedMicroBatch(
        input_ids=mb["input_ids"].reshape(1, -1), position_ids=mb["position_ids"].reshape(1, -1),
        scoring_positions=scoring, response_slots=torch.arange(b * length), response_shape=(b, length),
        sequence_starts=torch.tensor(bounds, dtype=torch.int32), bounds=bounds, longest=t)


def _forward(model: nn.Module, spec: PassSpec, mb: dict[str, Any]) -> torch.Tensor:
    """The pass's forward as the actor / critic run it; returns what the loss is taken of (B, L)."""
    from hflow.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    t, length = spec.seq, spec.response
    packed = _packed(spec, mb) if spec.packed else None
    if spec.model == "value":
        if packed is not None:
            values = packed.forward(model, use_cache=False).logits
            return packed.unpack_response(values[0, packed.scoring_positions, 0].float())
        inputs = {k: mb[k] for k in ("input_ids", "attention_mask", "position_ids")}
        return model(**inputs, use_cache=False).logits[:, t - length - 1: t - 1, 0].float()
    if packed is not None:
        scoring = packed.scoring_positions
        labels = packed.input_ids[:, scoring + 1]
        logits = packed.forward(model, use_cache=False, logits_to_keep=scoring).logits
    else:
        scoring = torch.arange(t - length - 1, t - 1)
        labels = mb["responses"]
        inputs = {k: mb[k] for k in ("input_ids", "attention_mask", "position_ids")}
        logits = model(**inputs, use_cache=False, logits_to_keep=scoring).logits
    logits = logits.div_(spec.temperature) if not torch.is_grad_enabled() else logits / spec.temperature
    out = logprobs_from_logits(logits, labels)
    if spec.entropy:
        out = out + entropy_from_logits(logits)
    if packed is not None:
        out = packed.unpack_response(out[0])
    return out


def _rollout_forward(model: nn.Module, spec: PassSpec) -> None:
    """One engine step's forward: `batch` sequences of `seq` tokens packed in one row (the step's
    max_num_batched_tokens, attention within each sequence as vLLM's kernels do), the logits of
    `logits_positions` sequences in fp32 (the sampler's)."""
    from hflow.utils.packing import PackedMicroBatch

    b, t = spec.batch, spec.seq
    bounds = tuple(i * t for i in range(b + 1))
    packed = PackedMicroBatch(
        input_ids=torch.zeros((1, b * t), dtype=torch.long), position_ids=torch.arange(t).repeat(b)[None],
        scoring_positions=torch.arange(spec.logits_positions), response_slots=torch.arange(spec.logits_positions),
        response_shape=(1, spec.logits_positions), sequence_starts=torch.tensor(bounds, dtype=torch.int32),
        bounds=bounds, longest=t)
    with torch.no_grad():
        logits = packed.forward(model, use_cache=False, logits_to_keep=packed.scoring_positions).logits
        torch.softmax(logits.float(), dim=-1)


class _ImageEncoding:
    """A vision-language model's pass traced with its vision tower in it, where the model's own forward runs
    it: inside the root module's forward (a forward pre-hook, after FSDP2's, which has gathered the root unit:
    the tower's patch embedding and merger), each vision block gathered by its own unit; in an update the
    tower's gradients are reduce-scattered and its optimizer state stepped like the rest. On one image of one
    merged token (`inputs`, from `_vision_inputs`): what the tower holds on the run's images is `_run_vision`'s
    trace. Without it an FSDP2 trace of several ranks fails (the tracker reads the gathered parameters of
    every unit after backward, and the tower's were never gathered) and one of one rank misses the tower's
    gradients and optimizer state."""

    def __init__(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        self.tower = _tower_for_trace(model)
        self.inputs = inputs
        self.features: torch.Tensor | None = None
        model.register_forward_pre_hook(self._encode)

    def _encode(self, module: nn.Module, args: Any) -> None:
        self.features = _encode_images(self.tower, self.inputs)

    def join(self, out: torch.Tensor) -> torch.Tensor:
        """`out` with the last forward's image features in its graph (times 0), so that backward runs through
        the tower, as it does through the image tokens of a real prompt."""
        features, self.features = self.features, None
        return out + 0 * features.float().sum()


def _run(model: nn.Module, spec: PassSpec, optim_cfg: Any, tower_inputs: dict[str, Any] | None = None) -> dict[str, int]:
    """Run the pass on `model` under a memory tracker; its peak by category (bytes, with "Total").
    `tower_inputs`: a vision-language model's one small image (`_ImageEncoding`)."""
    from hflow.workers.fsdp import build_optimizer, no_grad_pass, update_pass

    vocab = int(model.config.get_text_config().vocab_size)
    if spec.logits_positions is not None:  # the rollout engine's forward: one unsharded model, no FSDP
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            _rollout_forward(model, spec)
        return _peak(tracker)
    images = _ImageEncoding(model, tower_inputs) if tower_inputs is not None else None

    def forward(mb: dict[str, Any]) -> torch.Tensor:
        out = _forward(model, spec, mb)
        return images.join(out) if images is not None else out

    optimizer = None
    if spec.train:
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], optim_cfg)
        if spec.foreach_optimizer:  # foreach's temporaries bound fused AdamW's (none) from above
            for group in optimizer.param_groups:
                group["foreach"], group["fused"] = True, False
    batches = [_micro_batch(spec, vocab) for _ in range(spec.micro_batches if spec.train else 1)]
    if spec.train:
        # The steady state, as the CPU check counts it: one untraced step first. AdamW's moments exist from
        # then on. And the gradient clip's first call on these DTensors runs DTensor's sharding propagation,
        # which under fake tensors builds global-shaped gradients (W x the shards, all layers at once) that
        # the tracker would count; the propagation is cached, so the traced step does not.
        model.train()
        with update_pass(model) as update:
            update.before_backward(last=True)
            (forward(batches[0]) * batches[0]["advantages"]).sum().backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tracker = _tracker(model, optimizer, batches)
    with repeated_forwards(model, tracker), tracker:
        if spec.train:
            model.train()
            with update_pass(model) as update:  # as the actor and critic run their micro-batches
                for index, mb in enumerate(batches):
                    out = forward(mb)
                    update.before_backward(last=index == len(batches) - 1)
                    (out * mb["advantages"]).sum().backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            model.eval()
            with no_grad_pass(model):
                for mb in batches:
                    forward(mb)
    return _peak(tracker)


@contextlib.contextmanager
def repeated_forwards(model: nn.Module, tracker):
    """Around `tracker`'s context (enter this first): let the tracker follow several forwards of `model`
    (micro-batches). It keeps one set of per-module statistics, so they are cleared before each forward after
    the first (the peak so far is kept). A global hook, registered before the tracker's own, runs first."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    calls = [0]

    def before_forward(module: nn.Module, args: Any) -> None:
        if module is not model:
            return
        if calls[0]:
            tracker.reset_mod_stats()
        calls[0] += 1

    handle = register_module_forward_pre_hook(before_forward)
    try:
        yield
    finally:
        handle.remove()


# A plain module on one rank holds what would be its shards: named as FSDPMemTracker names them, so that the
# same phase reads the same at every world size.
_AS_SHARDS = {"Parameter": "Sharded Param", "Gradient": "Sharded Grad", "Optstate": "OptState"}


def _peak(tracker) -> dict[str, int]:
    [snapshot] = tracker.get_tracker_snapshot("peak").values() or [{}]
    peak = {getattr(k, "value", k): int(v) for k, v in snapshot.items() if int(v)}
    if isinstance(tracker, _PlainMemTracker):
        peak = {_AS_SHARDS.get(k, k): v for k, v in peak.items()}
    return peak


@contextlib.contextmanager
def _fake_world(world: int):
    """A fake process group of `world` ranks in this process (this process is rank 0), and its CPU mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the memory plan traces in a fake process group of its own: call it before "
                           "torch.distributed is initialised, or in another process")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


VISION_ATTENTION = "flash_attention_hflow_trace"  # a name transformers reads as a varlen (flash) kernel's


class _VarlenAttention(torch.autograd.Function):
    """What a varlen attention kernel (flash-attn, torch's CPU flash kernel) allocates: the output, and for
    backward q, k, v, the output and the row log-sum-exps (heads x N); no N x N scores. Values do not matter
    on fake tensors."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(query)
        ctx.save_for_backward(query, key, value, out, query.new_empty(query.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _varlen_attention_shape(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The vision tower's attention as transformers calls it: (1, heads, N, head_dim) in, (1, N, heads,
    head_dim) out (`_VarlenAttention`)."""
    return _VarlenAttention.apply(query, key, value).transpose(1, 2).contiguous(), None


def _vision_inputs(spec: PassSpec, vision: Any) -> dict[str, Any]:
    """Real (not fake) grid, vision positions and sequence bounds of the images: the tower reads their values
    (`tolist`), which fake tensors do not have; the pixels are made fake by the caller."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    merge = int(vision.spatial_merge_size)
    grid = torch.tensor([[1, merge, merge * k] for k in spec.image_tokens * spec.batch])
    bounds = get_vision_cu_seqlens(grid)
    channels = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    return {"grid_thw": grid, "cu_seqlens": bounds, "max_seqlen": int((bounds[1:] - bounds[:-1]).max()),
            "position_ids": get_vision_position_ids(grid, merge), "patches": int(grid.prod(-1).sum()),
            "channels": channels}


def _tower_for_trace(model: nn.Module) -> nn.Module:
    """`model`'s vision tower, its attention counted as a varlen kernel's (`_VarlenAttention`)."""
    from transformers import AttentionInterface

    from hflow.utils.vision import vision_tower

    AttentionInterface.register(VISION_ATTENTION, _varlen_attention_shape)
    tower = vision_tower(model)
    for module in tower.modules():
        if getattr(module, "config", None) is not None:
            module.config._attn_implementation = VISION_ATTENTION
    return tower


def _encode_images(tower: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The tower's merged features of `inputs`' images (`_vision_inputs`), from zero pixels."""
    kwargs = {k: inputs[k] for k in ("grid_thw", "cu_seqlens", "max_seqlen", "position_ids")}
    pixels = torch.zeros((inputs["patches"], inputs["channels"]))  # the processor's fp32 pixel_values
    return tower(pixels, **kwargs).pooler_output


def _run_vision(spec: PassSpec, inputs: dict[str, Any]) -> dict[str, int]:
    """The vision tower's forward (and, in an update whose tower trains, its backward) on the micro-batch's
    images, under torch's `MemTracker`: what it holds beside the language model's pass. Its parameters and
    gradients are the model's, counted by the pass's own trace."""
    dtype = spec.param_dtype or spec.model_dtype
    model = _build(replace(spec, image_tokens=(), model_dtype=dtype, lora=None))
    if spec.gradient_checkpointing and spec.train:
        from hflow.workers import fsdp

        fsdp.enable_gradient_checkpointing(model)
    tower = _tower_for_trace(model)
    tower.train(spec.train)
    tower.requires_grad_(spec.train)
    tracker = _PlainMemTracker()  # (a frozen tower's parameters take no gradient hooks)
    tracker.track_external(tower)
    with tracker, torch.set_grad_enabled(spec.train):
        merged = _encode_images(tower, inputs)
        if spec.train:
            merged.float().sum().backward()
    return _peak(tracker)


def trace_fake(spec: PassSpec, optim_cfg: Any = None) -> dict[str, int]:
    """The peak of `spec` on one of its `world` ranks, by category, counted on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    optim_cfg = optim_cfg or SimpleNamespace(lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01, kernel="foreach")
    vision = None
    if "vision_config" in json.loads(spec.model_config):
        from transformers import AutoConfig

        vision = AutoConfig.for_model(**json.loads(spec.model_config)).vision_config
    if spec.image_tokens:
        inputs = _vision_inputs(spec, vision)
        with FakeTensorMode(allow_non_fake_inputs=True):
            return _run_vision(spec, inputs)
    if spec.logits_positions is not None:
        with FakeTensorMode(allow_non_fake_inputs=True):
            return _run(_build(spec), spec, optim_cfg)
    # a vision-language model's pass encodes one image of one merged token (`_ImageEncoding`)
    one_image = _vision_inputs(replace(spec, image_tokens=(1,), batch=1), vision) if vision is not None else None
    with _fake_world(spec.world) as mesh, FakeTensorMode(allow_non_fake_inputs=True):  # the mesh is real
        model = _shard(_build(spec), spec, mesh)
        return _run(model, spec, optim_cfg, one_image)


def count_real_pass(phase: str, spec: PassSpec, config, mesh) -> dict[str, int]:
    """The pass of a plan's `phase` run for real on this rank, counted by the same tracker: the model's weights
    read by hflow's loader from `config`'s model path, sharded over `mesh` (a real process group of
    `spec.world` ranks), and hflow's `DataParallelPPOActor` / `DataParallelPPOCritic` doing `compute_log_prob`,
    `compute_values`, `update_policy` or `update_critic` on `spec`'s shapes. Rows are left-padded by one token
    as real prompts are (without remove-padding, that makes transformers build its attention mask, as in a
    real run). An update is counted on its second step, when AdamW's moments exist."""
    from hflow.protocol import DataProto
    from hflow.workers import fsdp
    from hflow.workers.config import normalize_actor_rollout_ref
    from hflow.workers.critic.config import normalize_critic

    world = mesh.size()
    arr = config.actor_rollout_ref
    loader = fsdp.load_value_model if spec.model == "value" else fsdp.load_causal_lm
    model = loader(str(arr.model.path), dtype=spec.model_dtype, attn_implementation=spec.attn_implementation)
    _shard(model, spec, mesh)
    b, t, length = spec.batch, spec.seq, spec.response
    rows = b * spec.micro_batches
    generator = torch.Generator().manual_seed(mesh.get_rank())
    ids = torch.randint(5, int(model.config.get_text_config().vocab_size), (rows, t), generator=generator)
    mask = torch.ones((rows, t), dtype=torch.long)
    mask[:, 0] = 0
    batch = {"input_ids": ids, "responses": ids[:, t - length:].clone(), "attention_mask": mask,
             "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
             "advantages": torch.randn((rows, length), generator=generator),
             "old_log_probs": torch.zeros((rows, length)), "ref_log_prob": torch.zeros((rows, length)),
             "values": torch.zeros((rows, length)), "returns": torch.randn((rows, length), generator=generator)}
    meta = {"temperature": float(arr.rollout.temperature), "micro_batch_size": b, "use_dynamic_bsz": False}
    data = DataProto.from_dict(batch, meta_info=meta)
    optimizer = None
    if spec.model == "value":
        from hflow.workers.critic import DataParallelPPOCritic

        cfg = normalize_critic(config.critic, world)
        cfg.ppo_mini_batch_size_per_rank, cfg.ppo_epochs, cfg.shuffle = rows, 1, False
        if spec.train:
            optimizer = fsdp.build_optimizer(model.parameters(), cfg.optim)
        critic = DataParallelPPOCritic(cfg, model, optimizer)
        run = (lambda: critic.update_critic(data)) if spec.train else (lambda: critic.compute_values(data))
    else:
        from hflow.workers.actor import DataParallelPPOActor

        norm = normalize_actor_rollout_ref(arr, "actor_rollout_ref", world)
        section = norm.ref if phase == "ref log-prob" else norm.actor
        if spec.train:
            section.ppo_mini_batch_size_per_rank, section.ppo_epochs, section.shuffle = rows, 1, False
            optimizer = fsdp.build_optimizer([p for p in model.parameters() if p.requires_grad],
                                                   norm.actor.optim)
        actor = DataParallelPPOActor(section, model, optimizer)
        run = ((lambda: actor.update_policy(data)) if spec.train
               else (lambda: actor.compute_log_prob(data, calculate_entropy=spec.entropy)))
    if spec.train:
        run()  # creates AdamW's moments
    tracker = _tracker(model, optimizer, [batch])
    with repeated_forwards(model, tracker), tracker:
        run()
    return _peak(tracker)


def _tracker(model: nn.Module, optimizer, inputs):
    """The tracker for `model` as `apply_fsdp2` left it: `FSDPMemTracker` for an FSDP2 model, torch's plain
    `MemTracker` for a model left unsharded on a mesh of one (its categories: params, grads, ...)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._pytree import tree_leaves

    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs(tuple(inputs))
        return tracker
    tracker = _PlainMemTracker()
    tensors = [t for t in tree_leaves(list(inputs)) if isinstance(t, torch.Tensor)]
    tracker.track_external(model, *([optimizer] if optimizer is not None else []), *tensors)
    return tracker


class _PlainMemTracker(MemTracker):
    """torch's `MemTracker` hooks the gradient of every parameter of each module it enters, which a frozen one
    (a reference model, a LoRA base weight) refuses: a module holding any such is not hooked, and its
    trainable leaves (LoRA's adapters) are when entered themselves."""

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
        trainable = all(p.requires_grad for p in module.parameters())
        return super()._track_module_params_and_buffers(module, install_grad_hooks and trainable)
