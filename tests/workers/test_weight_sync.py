"""The weight stream between the pools (`trainer.placement=split`): a gloo group of its own, outside the
default process group, carrying each tensor of the manifest in order, in the rollout's dtype."""

import dataclasses
import threading
import time
from collections import deque

import pytest
import torch

from hflow.single_controller.base.worker import get_free_port
from hflow.workers.weight_sync import StreamedWeights, WeightGroup, manifest_of, send_weights

WEIGHTS = {
    "model.embed_tokens.weight": torch.randn(16, 8),
    "model.layers.0.mlp.up_proj.weight": torch.randn(32, 8),
    "model.norm.weight": torch.rand(8),
    "model.odd": torch.rand(3),  # 12 bytes (6 in bf16): the next tensor in a bucket starts at an aligned offset
    "model.step": torch.tensor([7], dtype=torch.int64),  # non-float tensors keep their dtype
}


def counted(group: WeightGroup, counts: list[int]) -> WeightGroup:
    """`group`, counting its broadcasts (the collectives of the stream) into `counts` as they start."""
    start = group.start_broadcast

    def counting(tensor):
        counts.append(tensor.numel() * tensor.element_size())
        return start(tensor)

    group.start_broadcast = counting
    return group


def _run_group(receivers: int, wire_dtype: torch.dtype, sender_items, consume_all: bool = True,
               bucket_bytes: int | None = None, collectives: list | None = None):
    """One sender thread and `receivers` receiver threads; returns what each receiver got. `collectives`
    collects the sender's return and the broadcasts each receiver took part in."""
    manifest = dataclasses.replace(manifest_of([(n, t.shape, t.dtype) for n, t in WEIGHTS.items()], wire_dtype),
                                   bucket_bytes=bucket_bytes)
    port, world = get_free_port(), 1 + receivers
    received, errors = [None] * receivers, []
    collectives = [] if collectives is None else collectives
    collectives.extend([None] + [[] for _ in range(receivers)])

    def sender():
        try:
            group = WeightGroup("127.0.0.1", port, rank=0, world_size=world, timeout_s=30)
            collectives[0] = send_weights(group, manifest, sender_items)
        except Exception as err:  # noqa: BLE001 - surfaced below
            errors.append(err)

    def receiver(index):
        try:
            group = counted(WeightGroup("127.0.0.1", port, rank=1 + index, world_size=world, timeout_s=30),
                            collectives[1 + index])
            stream = StreamedWeights(group, manifest)
            got = {}
            for name, tensor in stream:
                got[name] = tensor.clone()
                if not consume_all:
                    break  # a loader that stops early: drain keeps the group in step
            assert stream.drain() == (0 if consume_all else len(WEIGHTS) - 1)
            received[index] = got
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=sender)] + [threading.Thread(target=receiver, args=(i,)) for i in range(receivers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return manifest, received, errors


def test_every_receiver_gets_every_tensor_exactly_in_the_rollout_dtype():
    manifest, received, errors = _run_group(2, torch.float32, list(WEIGHTS.items()))
    assert not errors, errors
    assert [name for name, _, _ in manifest.entries] == list(WEIGHTS)
    for got in received:
        assert list(got) == list(WEIGHTS)
        for name, tensor in WEIGHTS.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


# Bytes of WEIGHTS in fp32: embed 512, up_proj 1024, norm 32, odd 12, step 8 (int64); the fp32 plan and
# the number of broadcasts with a bf16 wire (floats at half the bytes).
BUCKETS = [
    (None, [[(0, 0)], [(1, 0)], [(2, 0)], [(3, 0)], [(4, 0)]], 5),  # today's stream: one tensor per broadcast
    # 600 B: the embedding fills a bucket; up_proj (1024 B) goes alone; the small three share one, the int64
    # at the 8-byte boundary after the 12 bytes of `odd`. bf16: embed (256) | up (512), norm, odd, step
    (600, [[(0, 0)], [(1, 0)], [(2, 0), (3, 32), (4, 48)]], 2),
    (2000, [[(0, 0), (1, 512), (2, 1536), (3, 1568), (4, 1584)]], 1),  # everything in one
]


@pytest.mark.parametrize("bucket_bytes,plan,_", BUCKETS)
def test_buckets_are_planned_greedily_in_manifest_order(bucket_bytes, plan, _):
    manifest = manifest_of([(n, t.shape, t.dtype) for n, t in WEIGHTS.items()], torch.float32)
    assert dataclasses.replace(manifest, bucket_bytes=bucket_bytes).buckets() == plan


@pytest.mark.parametrize("wire_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bucket_bytes,plan,bf16_broadcasts", BUCKETS)
def test_a_bucketed_stream_arrives_bitwise_equal_in_one_collective_per_bucket(bucket_bytes, plan, bf16_broadcasts,
                                                                             wire_dtype):
    expected = len(plan) if wire_dtype == torch.float32 else bf16_broadcasts
    collectives = []
    _, received, errors = _run_group(2, wire_dtype, list(WEIGHTS.items()), bucket_bytes=bucket_bytes,
                                     collectives=collectives)
    assert not errors, errors
    sent_bytes, broadcasts = collectives[0]
    assert broadcasts == expected
    for index, got in enumerate(received):
        assert len(collectives[1 + index]) == expected  # each receiver took part in exactly those broadcasts
        assert list(got) == list(WEIGHTS)
        for name, tensor in WEIGHTS.items():
            wire = tensor.to(wire_dtype) if tensor.is_floating_point() else tensor
            assert got[name].dtype == wire.dtype and got[name].shape == wire.shape, name
            assert torch.equal(got[name].view(torch.uint8), wire.view(torch.uint8)), name  # bitwise
    assert sent_bytes == sum(collectives[1])


def test_the_sender_gathers_the_next_bucket_while_this_one_is_on_the_wire():
    """Three buckets (600 B, fp32): the sender waits for bucket k's broadcast only after it has gathered and
    packed bucket k + 1, and once at the end for the last."""
    events = []

    def gathering():
        for name, tensor in WEIGHTS.items():
            events.append(("gather", name))
            yield name, tensor

    class Recorded:
        def __init__(self, work, index):
            self.work, self.index = work, index

        def wait(self):
            events.append(("wait", self.index))
            return self.work.wait()

    original = WeightGroup.start_broadcast

    def start(self, tensor):
        work = original(self, tensor)
        if self.rank != 0:
            return work
        index = sum(kind == "start" for kind, _ in events)
        events.append(("start", index))
        return Recorded(work, index)

    WeightGroup.start_broadcast = start
    try:
        _, received, errors = _run_group(1, torch.float32, gathering(), bucket_bytes=600)
    finally:
        WeightGroup.start_broadcast = original
    assert not errors, errors
    assert events == [("gather", "model.embed_tokens.weight"), ("start", 0), ("gather", "model.layers.0.mlp.up_proj.weight"),
                      ("start", 1), ("wait", 0), ("gather", "model.norm.weight"), ("gather", "model.odd"),
                      ("gather", "model.step"), ("start", 2), ("wait", 1), ("wait", 2)], events
    assert all(torch.equal(received[0][n], t) for n, t in WEIGHTS.items())


def test_a_receiver_posts_the_next_bucket_before_its_loader_takes_this_one():
    seen = []

    def receiving(group, manifest, counts):
        for name, _ in StreamedWeights(counted(group, counts), manifest):
            seen.append((name, len(counts)))

    manifest = dataclasses.replace(manifest_of([(n, t.shape, t.dtype) for n, t in WEIGHTS.items()], torch.float32),
                                   bucket_bytes=600)
    port = get_free_port()
    errors = []

    def sender():
        try:
            send_weights(WeightGroup("127.0.0.1", port, rank=0, world_size=2, timeout_s=30), manifest,
                         list(WEIGHTS.items()))
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=sender)
    thread.start()
    receiving(WeightGroup("127.0.0.1", port, rank=1, world_size=2, timeout_s=30), manifest, [])
    thread.join(timeout=60)
    assert not errors, errors
    assert [n for n, _ in seen] == list(WEIGHTS)
    assert [c for _, c in seen] == [2, 3, 3, 3, 3]  # the embedding handed over with up_proj already posted


def test_a_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="> 0 MiB"):
        manifest_of([(n, t.shape, t.dtype) for n, t in WEIGHTS.items()], torch.float32, bucket_mb=0)


def test_floating_tensors_travel_in_bf16_for_a_bf16_engine():
    manifest, received, errors = _run_group(1, torch.bfloat16, list(WEIGHTS.items()))
    assert not errors, errors
    got = received[0]
    assert got["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.norm.weight"], WEIGHTS["model.norm.weight"].to(torch.bfloat16))
    assert got["model.step"].dtype == torch.int64 and torch.equal(got["model.step"], WEIGHTS["model.step"])


def test_a_receiver_that_stops_early_drains_the_rest():
    _, received, errors = _run_group(1, torch.float32, list(WEIGHTS.items()), consume_all=False)
    assert not errors, errors
    assert list(received[0]) == ["model.embed_tokens.weight"]


def test_a_model_out_of_step_with_its_manifest_is_an_error_not_a_hang():
    manifest = manifest_of([(n, t.shape, t.dtype) for n, t in WEIGHTS.items()], torch.float32)
    swapped = list(WEIGHTS.items())
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(RuntimeError, match="out of step with its manifest"):
        send_weights(None, manifest, swapped)  # a non-sender rank checks the order too
    with pytest.raises(RuntimeError, match="fewer tensors"):
        send_weights(None, manifest, list(WEIGHTS.items())[:2])
    with pytest.raises(ValueError, match="at least one receiver"):
        WeightGroup("127.0.0.1", get_free_port(), rank=0, world_size=1)


def test_updates_are_announced_before_their_broadcasts_and_can_be_staged_in_host_memory():
    """A receiver busy generating polls the store: it sees nothing until the sender announces an update,
    then the update's version and count; `StagedWeights` takes the broadcasts at once into host memory
    (releasing the sender) and hands them over later, in order."""
    from hflow.workers.weight_sync import StagedWeights

    manifest = manifest_of([(n, t.shape, t.dtype) for n, t in WEIGHTS.items()], torch.float32)
    port = get_free_port()
    errors, sent = [], threading.Event()

    def sender():
        try:
            group = WeightGroup("127.0.0.1", port, rank=0, world_size=2, timeout_s=30)
            send_weights(group, manifest, list(WEIGHTS.items()), version=5)
            sent.set()
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=sender)
    thread.start()
    receiver = WeightGroup("127.0.0.1", port, rank=1, world_size=2, timeout_s=30)
    deadline = time.monotonic() + 30
    while receiver.updates_announced() == 0:  # the sender announces, then blocks in its first broadcast
        assert time.monotonic() < deadline and not errors, errors
    assert receiver.announced_version() == 5 and not sent.is_set()
    staged = StagedWeights(receiver, manifest, receiver.announced_version())
    assert receiver.updates_announced() == 1  # (read while the sender, which hosts the store, still runs)
    thread.join(timeout=30)
    assert sent.is_set() and not errors, errors  # released by staging, before anything was loaded
    assert staged.version == 5 and all(t.device.type == "cpu" for _, t in staged.tensors)
    got = dict(staged)
    assert list(got) == list(WEIGHTS) and all(torch.equal(got[n], t) for n, t in WEIGHTS.items())


class _Announcements:
    """The sender's side of the stream as a rollout rank sees it: updates announced, one outstanding at a time."""

    def __init__(self, *versions: int):
        self.versions = list(versions)
        self.taken = 0

    def updates_announced(self) -> int:
        return len(self.versions)

    def announced_version(self) -> int:
        return self.versions[self.taken]


@pytest.mark.parametrize("exact,loaded", [(False, [1, 2]), (True, [1])])
def test_a_deterministic_pool_samples_each_batch_with_exactly_its_version(monkeypatch, exact, loaded):
    """k >= 2: version 1 arrived (staged) while the pool generated, and version 2 is announced when the batch
    submitted at version 1 starts. Without exact versions the batch gets whatever arrived (2), so its weights
    depend on how far ahead the training pool ran; with them (trainer.deterministic) it gets 1, and 2 is
    taken off the stream, staged for the next batch, so the sender never waits on this one."""
    from hflow.workers import rollout_worker
    from hflow.workers.rollout_worker import RolloutWorker

    class Staged:
        def __init__(self, group, manifest, version):
            self.version = version
            group.taken += 1

    class Streamed(Staged):
        def __init__(self, group, manifest):
            group.taken += 1

        def drain(self):
            return 0

    monkeypatch.setattr(rollout_worker, "StagedWeights", Staged)
    monkeypatch.setattr(rollout_worker, "StreamedWeights", Streamed)
    worker = object.__new__(RolloutWorker)
    worker.weights_version, worker._updates_received, worker._load_s = 0, 0, 0.0
    worker._staged, worker._exact_versions, worker._tp_agree, worker.manifest = deque(), exact, None, object()
    worker.weight_group = _Announcements(1, 2)
    taken_into = []
    worker._load = lambda tensors, version: (taken_into.append(version), setattr(worker, "weights_version", version))
    worker._receive(into_engine=False)  # during the last generation: version 1, staged
    worker._catch_up(1, exact)  # the batch submitted at version 1 starts; version 2 is announced
    assert taken_into == loaded
    assert worker.weight_group.taken == 2  # both off the stream either way
    assert [s.version for s in worker._staged] == ([2] if exact else [])
    worker._catch_up(2, exact)  # the next batch gets version 2
    assert worker.weights_version == 2
