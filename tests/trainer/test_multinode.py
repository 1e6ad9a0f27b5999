"""The built-in task on a real two-node Ray cluster on this one host (README, "Multi-node").

`ray.cluster_utils.Cluster` starts a head node and a second node, each its own raylet with one CPU. hflow's
resource pools make one STRICT_PACK placement group per node entry, one `{"CPU": 1}` bundle per worker, so
with `trainer.nnodes=2 trainer.n_gpus_per_node=1` the two worker processes can only sit on different nodes:
colocated, the two FSDP/vLLM ranks; split, the training rank on one node and the standalone vLLM engine on
the other, joined by the weight stream. The trainer joins the cluster as a user would, through
`ray_init.address`, and must learn as on one node (validation <= 0.2 before training, >= 0.8 after it).
"""

import json
import subprocess
import sys

import pytest

from tests.trainer.test_command_line import main_ppo
from tests.trainer.learning import assert_learned, validation_curve

# alone: its cluster registers in /tmp/ray, where any other test's ray.init() would join it; slow: two nodes
pytestmark = [pytest.mark.alone, pytest.mark.slow]

STEPS = 4  # validation passes 0.8 from step 2 on; one step off-policy (async) dips below it after step 4

# The cluster lives in a process of its own. In this one it would share Ray's module-level state with the
# session's local Ray (tests/conftest.py, ray_session): Cluster.shutdown resets the driver's internal KV client.
# It answers "actors" on stdin with the actors' classes and nodes (read from the GCS: the state API needs the
# dashboard, which stays off), and shuts the cluster down when stdin closes.
CLUSTER_SCRIPT = '''
import json, sys
import ray._common.utils, ray._private.utils
from ray.cluster_utils import Cluster

# One CPU per node: one worker per node. A small object store: the default takes 30% of memory per node
# (batches here are a few hundred KB; weights go over torch.distributed, not the object store).
node = {"num_cpus": 1, "object_store_memory": 200 * 2**20}
cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
# Cluster records the head's address in /tmp/ray/ray_current_cluster, where any `ray.init()` on this host
# (other tests' local Ray, other work) would find and join it: take it back out.
if ray._private.utils.read_ray_address() == cluster.address:
    ray._common.utils.reset_ray_address()
cluster.add_node(**node)
cluster.wait_for_nodes()
print(json.dumps({"address": cluster.address, "nodes": [n.node_id for n in cluster.list_all_nodes()]}), flush=True)
for line in sys.stdin:
    actors = cluster.global_state.actor_table(None)
    print(json.dumps([{"id": actor_id, "class": a["ActorClassName"], "node": a["Address"]["NodeID"]}
                      for actor_id, a in actors.items()]), flush=True)
cluster.shutdown()
'''


class TwoNodeCluster:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        info = json.loads(proc.stdout.readline() or "null")
        assert info, "the two-node Ray cluster did not start"
        self.address, self.nodes = info["address"], info["nodes"]

    def actors(self) -> list[dict]:
        """Every actor the cluster has run (dead ones too): {"id", "class", "node"}."""
        self.proc.stdin.write("actors\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())


@pytest.fixture(scope="module")
def two_nodes():
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        yield TwoNodeCluster(proc)
    finally:
        proc.stdin.close()  # the script shuts the cluster down
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.terminate()  # Ray's handler kills the nodes' processes (and its reaper, should this process die)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("placement", [
    ["trainer.placement=colocate"],
    ["trainer.placement=split", "trainer.rollout_n_gpus=1", "trainer.async_steps=1"],
], ids=["colocate", "split-async"])
def test_builtin_task_learns_on_two_nodes(two_nodes, tmp_path, placement):
    before = {actor["id"] for actor in two_nodes.actors()}
    code, output, daemons = main_ppo(
        tmp_path, "algorithm.adv_estimator=grpo", f"ray_init.address={two_nodes.address}", "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1", f"trainer.total_training_steps={STEPS}", "trainer.test_freq=2",
        f"trainer.save_freq={STEPS}", *placement)
    assert code == 0, output[-4000:]
    assert not daemons  # it joined the cluster rather than start a Ray of its own

    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    assert_learned(validation_curve(records))
    # every rank wrote its shards into the one checkpoint folder (the trainer checked all nodes see it)
    checkpoints = tmp_path / "checkpoints" / "hflow" / "default"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)

    # one worker process on each node
    workers = [actor for actor in two_nodes.actors() if actor["id"] not in before]
    assert sorted(actor["node"] for actor in workers) == sorted(two_nodes.nodes), workers
    if "trainer.placement=split" in placement:
        assert sum("RolloutWorker" in actor["class"] for actor in workers) == 1, workers
        check_one_step_off_policy([r for r in records if "actor/pg_loss" in r])


def check_one_step_off_policy(steps: list[dict]) -> None:
    """trainer.async_steps=1: from step 2 on, the responses were sampled one update earlier, while the
    previous step trained, so the trainer waits for (almost) none of their generation."""
    assert [r["training/staleness"] for r in steps] == [0] + [1] * (len(steps) - 1)
    later = steps[1:]
    waited = sorted(r["timing_s/gen"] for r in later)[len(later) // 2]
    engine = sorted(r["timing_s/generate_worker"] for r in later)[len(later) // 2]
    assert waited < 0.5 * engine, (waited, engine)
    # sampled by the previous policy: the trainer's log-probs differ from the sampler's
    assert max(r["training/rollout_log_probs_diff_max"] for r in later) > 1e-3
