"""The driver's half of continuous admission (`actor_rollout_ref.rollout.admission=continuous`).

`RoutedGeneration` owns the run's `RowRouter` (a Ray actor, see `hflow.workers.rollout.router`): a batch's
samples are submitted to it, and the engines take them as they have room. Colocated, each batch is one
`generate_routed` call on every rank (the engines live in the training workers, between the weight sync on
entry and the release on exit, and serve only that batch). Split, each batch starts one `serve_routed` call
on every rollout rank; a call serves every batch submitted so far, so an engine takes the next batch's rows
while the previous batch's tail still runs, and a call that finds nothing left returns at once.
`RoutedCall.result()` waits for its batch's rows (not for the engines to drain), surfacing any worker's
error meanwhile, and assembles them in their original order, as the static path's output.
"""

from __future__ import annotations

import threading
import time

from hflow.protocol import DataProto
from hflow.single_controller.base import GroupCall, WorkerGroup
from hflow.utils.torch_functional import pad_2d_list_to_length
from hflow.workers.fsdp_workers import ActorRolloutRefWorker, engine_idle_metrics
from hflow.workers.rollout.base import assemble_rollout_output, pad_log_probs, prompt_token_ids, resolve_sampling
from hflow.workers.rollout.multi_turn import assemble_episodes
from hflow.workers.rollout.router import RowRouter
from hflow.workers.rollout_worker import RolloutWorker
from hflow.agent.loop import agent_metrics

__all__ = ["RoutedCall", "RoutedGeneration", "assemble_routed"]

CONTROL_KEYS = ("min_weights_version", "updates_in_flight", "exact_weights_version")  # the static path's; the router has its own


class RoutedGeneration:
    """The router and the serve calls of one run; `colocated` picks the workers' method (see the module)."""

    def __init__(self, generator: WorkerGroup, rollout_config, colocated: bool) -> None:
        import ray

        self.generator = generator
        self.config = rollout_config  # actor_rollout_ref.rollout
        self.colocated = colocated
        self.router = ray.remote(RowRouter).options(num_cpus=0).remote(generator.world_size)
        self.count = 0  # batches submitted
        self.serving: list[GroupCall] = []  # calls whose errors surface while a batch is awaited
        self._lock = threading.Lock()  # batches are awaited on the scoring thread too

    def start(self, gen_batch: DataProto, min_version: int) -> RoutedCall:
        """Submit `gen_batch`'s samples (prompt-major, n each) and start the engines' calls for it."""
        import ray

        batch = self.count
        self.count += 1
        meta = {k: v for k, v in gen_batch.meta_info.items() if k not in CONTROL_KEYS}
        n = resolve_sampling(self.config, meta).n
        tools_kwargs = gen_batch.non_tensor_batch.get("tools_kwargs")
        agent_kwargs = gen_batch.non_tensor_batch.get("agent_kwargs")  # the environment's and user's choice
        rows = [{"ids": ids, "tools_kwargs": (tools_kwargs[i] if tools_kwargs is not None else None) or {},
                 "agent_kwargs": (agent_kwargs[i] if agent_kwargs is not None else None) or {}}
                for i, ids in enumerate(prompt_token_ids(gen_batch)) for _ in range(n)]
        ray.get(self.router.submit.remote(batch, rows, meta, min_version))
        if self.colocated:
            call = self.generator.start(ActorRolloutRefWorker.generate_routed, self.router, batch)
        else:
            call = self.generator.start(RolloutWorker.serve_routed, self.router)
        self.watch(call)
        return RoutedCall(self, batch, gen_batch, meta, n, call)

    def watch(self, call: GroupCall) -> None:
        with self._lock:
            self.serving.append(call)

    def check(self) -> None:
        """Collect the calls that ended: a worker's error is raised here, while a batch is awaited."""
        with self._lock:
            ended = [c for c in self.serving if c.ready()]
            self.serving = [c for c in self.serving if c not in ended]
        for call in ended:
            call.result()


class RoutedCall:
    """One routed batch in flight: `result()` is its rollout output, like a `GroupCall` of the static path."""

    def __init__(self, owner: RoutedGeneration, batch: int, prompts: DataProto, meta: dict, n: int,
                 call: GroupCall) -> None:
        self.owner, self.batch, self.prompts, self.meta, self.n, self.call = owner, batch, prompts, meta, n, call
        self.started = time.perf_counter()
        self._output: DataProto | None = None

    def result(self) -> DataProto:
        import ray

        if self._output is not None:
            return self._output
        router = self.owner.router
        while not ray.get(router.complete.remote(self.batch)):
            self.owner.check()
            time.sleep(0.01)
        if self.owner.colocated:  # the engines give the devices back on return
            self.owner.check()
            self.call.result()
        collected = ray.get(router.collect.remote(self.batch))
        self.engine_of = collected["engine_of"]  # which engine ran each sample (every turn of it)
        self._output = assemble_routed(self.prompts, self.meta, self.n, collected, self.owner.config,
                                       colocated=self.owner.colocated)
        return self._output


def assemble_routed(gen_batch: DataProto, meta: dict, n: int, collected: dict, config,
                    colocated: bool = False) -> DataProto:
    """The rollout output of a routed batch (`RowRouter.collect`'s), in its rows' order, with the metrics of
    the static path and each engine's idle seconds and share (`config`: the rollout section): since the
    previous batch on an engine of its own, within the batch for a colocated one (the devices train between)."""
    prompts = DataProto(batch=gen_batch.batch, non_tensor_batch=dict(gen_batch.non_tensor_batch),
                        meta_info={**collected["resolved"], **meta})
    results, width = collected["results"], int(config.response_length)
    pad = prompts.meta_info["pad_token_id"]
    log_probs = bool(config.calculate_log_probs)
    metrics: dict[str, list[float]] = {}
    if config.multi_turn.enable:
        output = assemble_episodes(prompts, results, n, pad, log_probs, width)
        metrics.update({k: [v] for k, v in agent_metrics(results, collected["wall_s"]).items()})
    else:
        responses = pad_2d_list_to_length([r["tokens"] for r in results], pad, max_length=width)
        output = assemble_rollout_output(prompts, responses, n,
                                         pad_log_probs([r["log_probs"] for r in results], width) if log_probs else None)
        if results and results[0]["versions"] is not None:
            output.batch["rollout_versions"] = pad_2d_list_to_length([r["versions"] for r in results], -1,
                                                                     max_length=width)
    metrics["timing_s/generate_worker"] = [collected["wall_s"]]
    idle_s, window = ((collected["idle_in_batch_s"], collected["wall_s"]) if colocated
                      else (collected["idle_s"], collected["window_s"]))
    for engine, (idle, rows) in enumerate(zip(idle_s, collected["rows_per_engine"])):
        for key, value in engine_idle_metrics(engine, idle, window).items():
            metrics.setdefault(key, []).append(value)
        metrics[f"rollout/rows/engine{engine}"] = [float(rows)]
    output.meta_info["metrics"] = metrics
    return output

