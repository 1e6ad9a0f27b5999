"""Everything about reward, in one room.

    score/            rule-based scorers by ``data_source`` (the reward-function contract)
    runner.py         runs scoring functions in worker processes with a deadline that really stops a call
    managers/         reward managers (naive, batch, dapo, user-registered) and the remote scorer
    shaping.py        reward normalisation and KL-free shaping of scores
    dynamic_sampling.py  DAPO's group filter (algorithm.filter_groups) and overlong-buffer checks
    judge.py          the generative judge's prompt and verdict parsing; judge_worker.py runs it
    audit.py          `python -m hflow.reward.audit`: try a reward on families of gaming responses

This package's ``__init__`` imports nothing: the scoring processes import ``hflow.reward.score`` and must
start fast (no torch).
"""
