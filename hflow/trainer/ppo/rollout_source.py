"""Where the PPO trainer's batches come from: prompts drawn from the data loader, their responses sampled.

One interface for both placements (`trainer.placement`): the trainer asks for the next batch
(`next`/`take`, then `scored`) and says when the actor has new weights (`weights_updated`,
`weights_restored`). `RolloutSource` generates on the actor's own engine (colocated: the worker syncs the
engine's weights itself on every generation); `SplitRolloutSource` on a rollout pool of its own,
joined to the actor by the weight stream.

With `trainer.async_steps=k >= 1` up to k batches are in flight: each was submitted with the weights of
its time, and a driver thread scores each batch as soon as its generation ends, while training goes on.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from hflow.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from hflow.single_controller.base import GroupCall, WorkerGroup
from hflow.workers.fsdp_workers import ActorRolloutRefWorker
from hflow.workers.rollout_worker import RolloutWorker
from hflow.trainer.ppo.metric_utils import reduce_metrics
from hflow.trainer.ppo.routed_rollout import RoutedGeneration


@contextmanager
def timer(name: str, timing: dict[str, float]):
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def pop_generation_inputs(batch: DataProto) -> DataProto:
    """Move what generation reads (prompt ids, masks, positions, raw prompts, images) out of `batch`. The
    images' vision inputs come back with every sample in the rollout's output, for the forwards."""
    keys = ("raw_prompt_ids", "raw_prompt", "tools_kwargs", "agent_kwargs", "multi_modal_data", "multi_modal_inputs")
    return batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"],
                     non_tensor_batch_keys=[k for k in keys if k in batch.non_tensor_batch])


def describe_rollout_pool(ranks: list[dict[str, int]]) -> str:
    """One line on what the rollout pool's engines really run (from each rank's `engine_info`)."""
    tp = ranks[0]["tensor_parallel_size"]
    rows = ", ".join(str(r["embedding_rows"]) for r in ranks)
    return (f"rollout pool: {len(ranks)} ranks = {len(ranks) // tp} vLLM engine(s) x tensor_parallel_size {tp}; "
            f"embedding rows held per rank: {rows} (vocabulary {ranks[0]['vocab_size']})")


@dataclass
class PendingRollout:
    """A batch of prompts whose responses are being (or have been) generated.

    `version` is the oldest policy version whose weights may sample them (actor updates so far when it
    was submitted; the rollout pool's tokens record their own, which may be newer); `loader_state`
    is the data loader's position before this batch was drawn (a checkpoint saved while the batch is
    in flight resumes by drawing it again). `receive` is the weight update submitted to the rollout
    pool just before this batch, if any (its errors surface when the batch is taken).
    """

    batch: DataProto
    gen_batch: DataProto
    call: GroupCall  # or a RoutedCall (continuous admission): result() is the output either way
    version: int
    loader_state: dict
    output: DataProto | None = None
    receive: GroupCall | None = None
    scored: Future | None = None  # (batch, reward, metrics): scored on the scoring thread as generation ends


# Steps 2-3 of the trainer for one batch: (rollout, metrics, timing) -> (scored batch, reward result)
ScoreRollout = Callable[[PendingRollout, dict, dict], tuple[DataProto, dict]]


class RolloutSource:
    """The batches of a colocated run: the actor's own engine generates (`generator` is the actor's group).

    `score` is the trainer's scoring of a taken batch (steps 2-3), run on the scoring thread in
    asynchronous runs without a reward model (a reward model is a worker of the training pool: it scores
    in the step). `version` counts the actor's updates (the policy version).
    """

    engine_worker = ActorRolloutRefWorker  # the worker class whose engine generates

    def __init__(self, config, generator: WorkerGroup, train_dataloader, score: ScoreRollout | None = None):
        self.generator = generator
        self.train_dataloader = train_dataloader
        self.score = score
        self.version = 0  # actor updates so far
        self.async_steps = int(config.trainer.async_steps)  # k: batches generated ahead, the staleness bound
        self._batches = self._epoch_batches()
        self._pending: deque[PendingRollout] = deque()  # submitted, oldest first
        self._receive: GroupCall | None = None  # split placement: the last weight update submitted to the pool
        self._scoring = (ThreadPoolExecutor(1, thread_name_prefix="hflow-scoring")
                         if self.async_steps and not config.reward_model.enable else None)
        rollout = config.actor_rollout_ref.rollout
        # continuous admission (one engine on the local backend: nothing to route)
        self._routed = rollout.admission == "continuous" and config.trainer.backend == "ray"
        self._routing: RoutedGeneration | None = None
        self._rollout_config = rollout

    def _epoch_batches(self):
        """Batches from the loader's current position on, epoch after epoch (the loader is resumable and
        counts its own epochs; each epoch's order is a permutation seeded by data.seed + epoch)."""
        while True:
            yield from self.train_dataloader

    # ------------------------------------------------------------------ placement-specific

    def start(self, seed: int) -> None:
        """Start the engines (colocated: the actor's `init_model` builds its own, last in its process)."""

    def connect(self) -> None:
        """Join the engines to the actor once every model is loaded (colocated: they share its process)."""

    def _push_weights(self) -> None:
        """Colocated: the worker syncs its engine on every generation."""

    def _generation_meta(self, gen_batch: DataProto) -> None:
        """What the engines must know of the weights before generating `gen_batch` (colocated: nothing)."""

    def _take_stream_metrics(self) -> dict[str, float]:
        return {}

    def weights_restored(self, restored_version: int | None) -> dict[str, float]:
        """The actor's weights were put back (a health rollback) to those of policy version `restored_version`
        (None: a state older than any batch in flight, a checkpoint's); returns what became of the batches in
        flight (`trainer.async_steps` >= 1).

        A batch sampled only by the restored weights or older ones (submitted at a version <= the restored
        one, and, where updates reach the engines during a generation, with no token of a newer version)
        stays, within the staleness bound. A batch that weights newer than the restored ones sampled (the
        ones the rollback discards) is dropped: its generation is awaited and thrown away, and its prompts
        are skipped, as the failed batch's are. Versions keep counting up: the restored weights go to the
        engines with the next batch under a new number, so no staleness is under-counted."""
        kept: deque[PendingRollout] = deque()
        dropped = 0
        while self._pending:
            rollout = self._pending.popleft()
            stale = restored_version is None or rollout.version > restored_version
            if not stale and self._rollout_config.partial_rollout:  # tokens may be newer than the batch
                self._await(rollout)
                versions = rollout.output.batch.get("rollout_versions") if rollout.output is not None else None
                stale = versions is not None and bool((versions > restored_version).any())
            if stale:
                self._await(rollout)
                dropped += 1
            else:
                kept.append(rollout)
        self._pending = kept
        return {"health/in_flight_kept": float(len(kept)), "health/in_flight_dropped": float(dropped)}

    def _await(self, rollout: PendingRollout) -> None:
        """Wait for a batch in flight to be generated (and scored, on the scoring thread); an error stays
        with the batch, raised where it is used (a dropped batch's never is)."""
        if rollout.scored is not None:
            rollout.scored.exception()
        elif rollout.output is None:
            try:
                self._collect(rollout)
            except Exception as err:  # noqa: BLE001 - kept for the batch's own use
                rollout.scored = Future()
                rollout.scored.set_exception(err)

    def state_dict(self) -> dict:
        """The rollout pool's own state for a checkpoint (colocated: the actor's checkpoint has it all)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def shutdown(self) -> None:
        if self._scoring is not None:
            self._scoring.shutdown(cancel_futures=True)

    # ------------------------------------------------------------------ the interface

    @property
    def world_size(self) -> int:
        return self.generator.world_size

    def weights_updated(self) -> None:
        """The actor was updated: batches submitted from now on are sampled with the new version."""
        self.version += 1

    def next(self, timing: dict[str, float], steps_after: int) -> tuple[PendingRollout, dict[str, float]]:
        """This step's prompts and their sampled responses (`rollout.output`), with the generation's metrics.

        With `trainer.async_steps=0` they are generated now, with the current weights. With k >= 1 they
        were generated while earlier steps trained, with weights at most k updates old, and the batch k
        steps ahead starts generating before this one trains (none beyond the run: `steps_after` is the number
        of training steps after this one).
        """
        rollout = self.take(timing, steps_after)
        metrics = self._take_stream_metrics()
        metrics.update(reduce_metrics(rollout.output.meta_info.pop("metrics", {})))
        return rollout, metrics

    def take(self, timing: dict[str, float], steps_after: int) -> PendingRollout:
        """The oldest batch in flight (started now if none), with its responses; then the pipeline is
        topped up to `trainer.async_steps` batches ahead, each generated with the weights of now."""
        if not self._pending:
            self._pending.append(self._start())
        rollout = self._pending.popleft()
        with timer("gen", timing):  # with async_steps >= 1: only the part of generation training did not hide
            if rollout.scored is not None:
                rollout.scored.exception()  # generated and scored (its errors are raised where it is used)
            else:
                self._collect(rollout)
        while len(self._pending) < min(self.async_steps, steps_after):
            self._pending.append(self._start())
        return rollout

    def scored(self, rollout: PendingRollout, metrics: dict[str, float],
               timing: dict[str, float]) -> tuple[DataProto, dict]:
        """The trainer's steps 2-3 for `rollout` (`score`), or their result from the scoring thread when it
        ran there; adds the reward metrics to `metrics`."""
        if rollout.scored is None:
            return self.score(rollout, metrics, timing)
        batch, reward, scored_metrics = rollout.scored.result()
        metrics.update(scored_metrics)
        return batch, reward

    def bound_staleness(self, batch: DataProto, submitted_version: int) -> dict[str, float]:
        """Per token, how many policy versions the sampler was behind the policy this step updates
        (`rollout_versions`: each token's own; without them, the version the batch was submitted with).
        A sample with a token more than `trainer.async_steps` versions old is dropped from the loss (its
        response mask zeroed) and counted; the pipeline never makes one, so this is the bound's guard."""
        mask = batch.batch["response_mask"].bool()
        if "rollout_versions" in batch.batch.keys():
            staleness = self.version - batch.batch["rollout_versions"]
        else:
            staleness = torch.full(mask.shape, self.version - submitted_version)
        too_old = ((staleness > self.async_steps) & mask).any(-1)
        if too_old.any():
            batch.batch["response_mask"][too_old] = 0
        values = staleness[mask].float()
        if values.numel() == 0:
            values = torch.zeros(1)
        return {"training/staleness/mean": values.mean().item(), "training/staleness/max": values.max().item(),
                "training/staleness": values.max().item(),  # the batch's oldest token (its name before k > 1)
                "training/staleness/dropped_samples": float(too_old.sum())}

    def loader_state(self) -> dict:
        """The data position a checkpoint saves: batches in flight are not saved, a resumed run draws them
        again and generates them with its weights."""
        return self._pending[0].loader_state if self._pending else self.train_dataloader.state_dict()

    def generate(self, batch: DataProto, **meta) -> DataProto:
        """`batch` with responses generated now for its prompts, by the current policy (validation, the
        reward normalisation's fit); `meta` goes to the engines (e.g. `n`, `do_sample`, `validate`)."""
        gen_batch = pop_generation_inputs(batch)
        gen_batch.meta_info.update(meta)
        self._push_weights()  # split placement: the engines may be one update behind
        padded, pad_size = pad_dataproto_to_divisor(gen_batch, self.world_size)
        output = unpad_dataproto(self.generator.call(self.engine_worker.generate_sequences, padded), pad_size)
        output.meta_info.pop("metrics", None)
        return batch.union(output)

    def generate_greedy(self, gen_batch: DataProto) -> DataProto:
        """ReMax's greedy responses to the prompts of `gen_batch` (a batch in flight's generation inputs)."""
        greedy_batch = DataProto(batch=gen_batch.batch, non_tensor_batch=dict(gen_batch.non_tensor_batch),
                                 meta_info={**gen_batch.meta_info, "do_sample": False})
        return self.generator.call(self.engine_worker.generate_sequences, greedy_batch)

    def describe(self) -> str:
        """What the engines hold, rank by rank (vLLM only)."""
        return describe_rollout_pool(self.generator.call(self.engine_worker.engine_info))

    # ------------------------------------------------------------------ the pipeline

    def _start(self) -> PendingRollout:
        """Draw the next batch of prompts and start generating for it with the actor's latest weights."""
        loader_state = self.train_dataloader.state_dict()  # a checkpoint taken meanwhile re-draws this batch
        batch = DataProto.from_single_dict(next(self._batches))
        gen_batch = pop_generation_inputs(batch)
        self._push_weights()
        self._generation_meta(gen_batch)
        receive, self._receive = self._receive, None
        if self._routed:
            if self._routing is None:
                self._routing = RoutedGeneration(self.generator, self._rollout_config,
                                                 colocated=self.engine_worker is ActorRolloutRefWorker)
            call = self._routing.start(gen_batch, min_version=self.version)
        else:
            call = self.generator.start(self.engine_worker.generate_sequences, gen_batch)
        rollout = PendingRollout(batch, gen_batch, call, self.version, loader_state, receive=receive)
        if self._scoring is not None:
            rollout.scored = self._scoring.submit(self._generate_and_score, rollout)
        return rollout

    def _generate_and_score(self, rollout: PendingRollout) -> tuple[DataProto, dict, dict[str, float]]:
        """On the scoring thread: wait for the batch's responses, then score them (steps 1-3)."""
        self._collect(rollout)
        metrics, timing = {}, {}
        batch, reward = self.score(rollout, metrics, timing)
        metrics["timing_s/reward_overlapped"] = timing.get("reward", 0.0)
        return batch, reward, metrics

    def _collect(self, rollout: PendingRollout) -> None:
        if rollout.receive is not None:
            if self._routing is not None:  # it may queue behind serve calls that run later batches too
                self._routing.watch(rollout.receive)
            else:
                rollout.receive.result()  # the weight update before it: its errors surface here
        rollout.output = rollout.call.result()


class SplitRolloutSource(RolloutSource):
    """The batches of a split run (`trainer.placement=split`): a rollout pool of standalone vLLM engines
    (`generator`, its own group on its own devices) generates; the actor streams its weights to it."""

    engine_worker = RolloutWorker

    def __init__(self, config, generator: WorkerGroup, train_dataloader, actor: WorkerGroup,
                 score: ScoreRollout | None = None):
        super().__init__(config, generator, train_dataloader, score)
        self.actor = actor
        self.engine_version = -1  # the version the rollout pool's engines hold
        self._stream_metrics: dict[str, float] = {}  # the latest weight stream's, for the next step's log
        self._weight_manifest = None
        self._starting: GroupCall | None = None  # the rollout pool's init_model
        # trainer.deterministic: a batch is sampled by exactly the version it was submitted with (the pool
        # stages newer updates for later batches), not by whatever arrived before its generation started
        self.exact_versions = bool(config.trainer.deterministic)

    def start(self, seed: int) -> None:
        """Seed the rollout pool and start building its engines (they start while the models load)."""
        self.generator.execute_all_sync("seed_everything", seed)
        self._starting = self.generator.start(RolloutWorker.init_model)

    def connect(self) -> None:
        """Wait for the engines, then open the weight stream: a process group over the actor's rank 0 and
        every rollout rank (see hflow.workers.weight_sync)."""
        self._starting.result()
        addr, port = self.actor.execute_rank_zero_sync("pick_rendezvous_address")
        world = 1 + self.generator.world_size
        self._weight_manifest = self.actor.call(ActorRolloutRefWorker.weight_manifest)
        joins = [self.actor.start(ActorRolloutRefWorker.join_weight_group, addr, port, world),
                 self.generator.start(RolloutWorker.join_weight_group, addr, port, world, self._weight_manifest)]
        for join in joins:
            join.result()

    def _push_weights(self) -> None:
        """Stream the actor's weights to the rollout pool unless the engines already have this version.
        Its timing is reported with the step that follows.

        The send returns once every rollout rank took the update: an idle rank through `receive_weights`,
        a rank that is generating between two engine steps (with trainer.async_steps >= 2 or partial
        rollouts; at k <= 1 the pool is idle here). The rollout pool's own call is collected later."""
        if self.engine_version == self.version:
            return
        started = time.perf_counter()
        send = self.actor.start(ActorRolloutRefWorker.send_weights, self._weight_manifest, self.version)
        self._receive = self.generator.start(RolloutWorker.receive_weights, self._weight_manifest, self.version,
                                             self.exact_versions)
        sent = send.result()[0]
        self.engine_version = self.version
        self._stream_metrics = {"timing_s/weight_stream": time.perf_counter() - started,
                                "perf/weight_stream_gb": sent["bytes"] / 1e9,
                                "perf/weight_stream_collectives": sent["collectives"]}

    def _generation_meta(self, gen_batch: DataProto) -> None:
        gen_batch.meta_info["min_weights_version"] = self.version  # the pool waits for this version's weights
        # more batches queue behind this one: updates must reach the pool while it generates
        gen_batch.meta_info["updates_in_flight"] = self.async_steps >= 2
        gen_batch.meta_info["exact_weights_version"] = self.exact_versions

    def _take_stream_metrics(self) -> dict[str, float]:
        metrics, self._stream_metrics = self._stream_metrics, {}
        return metrics

    def weights_restored(self, restored_version: int | None) -> dict[str, float]:
        self.engine_version = -1  # the rollout pool gets the restored weights with the next batch started
        return super().weights_restored(restored_version)

    def state_dict(self) -> dict:
        return {"rollout_generation": self.generator.generation_state()}

    def load_state_dict(self, state: dict) -> None:
        generation = state.get("rollout_generation")
        if generation and len(generation) == self.generator.world_size:
            self.generator.load_generation_state(generation)

    def shutdown(self) -> None:
        super().shutdown()
        self.generator.shutdown()
