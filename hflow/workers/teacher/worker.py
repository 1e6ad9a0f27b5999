"""`TeacherWorker`: the distillation teacher, a frozen causal LM placed like the reference policy.

The trainer puts it in the training pool, so through the colocated worker class it shares each device's
process with the actor (and the actor's engine when colocated); with `trainer.placement=split` the training
pool is the devices that do not generate, so there too it sits beside the actor, off the rollout engines.
It is read from disk by rank 0 only and sharded with FSDP2 like the reference, and (`teacher.fsdp_config.
param_offload`, on by default) waits in host memory between the once-per-step passes.

It scores the student's tokens as they were sampled, whatever policy version sampled them (asynchronous
steps) and whatever the loss mask says (tool tokens are masked later, by the reward); its log-probs come from
the same entry point as the actor's and the reference's (`DataParallelPPOActor.compute_log_prob`), at the
rollout's temperature.
"""

from __future__ import annotations

from omegaconf import DictConfig

from hflow.protocol import DataProto
from hflow.single_controller.base import Dispatch, Worker, register
from hflow.utils import device
from hflow.workers.fsdp_workers import FSDPModelHolder
from hflow.workers.teacher.config import normalize_teacher, teacher_models


class TeacherWorker(Worker, FSDPModelHolder):
    """The `teacher` subtree: `compute_teacher_log_prob`."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.raw_config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hflow.workers import fsdp
        from hflow.workers.actor import DataParallelPPOActor

        self.config = normalize_teacher(self.raw_config)
        self.init_distributed()
        self.device_mesh = fsdp.build_device_mesh(self.world_size)
        self._offload_param = bool(self.config.fsdp_config.param_offload)
        # {name: (FSDP module, its log-prob entry point)}: "" for teacher.model, else one per data source
        self.teachers = {}
        for name, model_cfg in teacher_models(self.config).items():
            module, _, _ = self._build_trainable(fsdp.load_frozen_causal_lm(model_cfg), self.config.fsdp_config, None,
                                                 gradient_checkpointing=False, train=False)
            self.teachers[name] = (module, DataParallelPPOActor(self.config, module))
            self._offload(module, None, self._offload_param, False)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """The teacher's log-probs of the sampled responses, `teacher_log_prob` (B, L); with
        `meta_info["topk"]` = k > 0 (the trainer's, where the GKD term needs it), also the teacher's k most
        likely tokens at each response position from the same forward: `teacher_topk_ids` (B, L, k) int32
        and `teacher_topk_log_probs` (B, L, k), at the same temperature. `meta_info["teacher"]` names the
        model (a `teacher.by_data_source` key; "" or absent: `teacher.model`): every rank scores with the same
        one, so the trainer sends each data source's rows in a call of their own."""
        name = str(data.meta_info.get("teacher", ""))
        if name not in self.teachers:
            raise KeyError(f"the teacher worker has no model {name!r} (it has {sorted(self.teachers)})")
        module, teacher = self.teachers[name]
        self._onload(module, None, self._offload_param, False)
        topk = int(data.meta_info.get("topk", 0))
        data.meta_info.update(
            micro_batch_size=self.config.log_prob_micro_batch_size_per_gpu,
            max_token_len=self.config.log_prob_max_token_len_per_gpu,
            use_dynamic_bsz=self.config.log_prob_use_dynamic_bsz,
            temperature=self.config.temperature,  # the sampler's T, as for the student's log-probs
        )
        data = data.to(device.get_device())
        if topk > 0:
            log_probs, topk_ids, topk_log_probs = teacher.compute_log_prob_and_topk(data, topk)
            columns = {"teacher_log_prob": log_probs.cpu(), "teacher_topk_ids": topk_ids.cpu(),
                       "teacher_topk_log_probs": topk_log_probs.cpu()}
        else:
            log_probs, _ = teacher.compute_log_prob(data, calculate_entropy=False)
            columns = {"teacher_log_prob": log_probs.cpu()}
        self._offload(module, None, self._offload_param, False)
        return DataProto.from_dict(columns)
