"""The 8-device shape of one GPU node, on 8 CPU worker processes: the built-in task learns with nothing but
`trainer.n_gpus_per_node=8` changed, colocated and split, with vLLM tensor parallelism 2.

Tensor parallelism is checked on what the engines really hold: each rank of a TP-2 engine keeps half of the
(padded) embedding rows, not a full copy, and its log-probs still match the trainer's in fp32.
"""

import re

import pytest

from tests.trainer.test_placement import _learned, run_builtin

# alone: eight workers and their engines need most of the machine's memory; slow: eight ranks
pytestmark = [pytest.mark.alone, pytest.mark.slow]

EIGHT = ("trainer.n_gpus_per_node=8", "ray_init.num_cpus=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
         "trainer.total_training_steps=4", "trainer.test_freq=4",
         "algorithm.rollout_check_freq=1")  # the sampler-vs-trainer check at every step, after every sync


# Colocated, the shape users run on a node. (Split with TP 2 -- 4 training ranks, 2 engines -- passes the same
# checks; it is left out of the suite for time: tests/trainer/test_placement.py and the two-node test cover split.)
@pytest.mark.parametrize("placement", [["trainer.placement=colocate"]], ids=["colocate"])
def test_eight_workers_learn_with_tensor_parallel_engines(ray_session, tmp_path, capsys, placement):
    records = run_builtin(tmp_path, *EIGHT, *placement)
    _learned(records)
    for step in (r for r in records if "actor/pg_loss" in r):
        assert step["training/rollout_log_probs_diff_max"] < 1e-4, step
    # Both placements print what every rollout rank's engine really holds (from its model, not its config).
    ranks = 4 if "trainer.placement=split" in placement else 8
    line = re.search(r"rollout pool: .*", capsys.readouterr().out).group(0)
    assert f"{ranks} ranks = {ranks // 2} vLLM engine(s) x tensor_parallel_size 2" in line, line
    rows = [int(r) for r in re.search(r"held per rank: ([\d, ]+)", line).group(1).split(",")]
    vocabulary = int(re.search(r"vocabulary (\d+)", line).group(1))
    # vLLM pads the vocabulary to a multiple of 64 and gives each TP rank half: two copies would hold it all
    assert rows == [-(-vocabulary // 64) * 64 // 2] * ranks, line
