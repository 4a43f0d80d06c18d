"""One process holding the whole batch computes what 2 torchrun ranks holding halves compute: every advantage
estimator, whitening and the in-reward KL's batch mean (core_algos' all_sum argument).

    python -m pytest tests/test_core_algos.py -q
"""

import os
import subprocess
import sys

import torch
from dist_core_algos import ESTIMATORS, compute, whole_batch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_core_algos.py")


def test_one_process_on_the_whole_batch_equals_two_ranks_on_halves(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
           "--rdzv-endpoint=localhost:0", WORKER, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    halves = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    whole = compute(whole_batch(), all_sum=None)

    def joined(key):
        return [torch.cat(parts) for parts in zip(halves[0][key], halves[1][key])]

    for name in ESTIMATORS:
        for got, expected in zip(joined(name), whole[name]):  # advantages, returns
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(torch.cat([h["whiten"] for h in halves]), whole["whiten"], atol=1e-6, rtol=0)
    rewards = torch.cat([h["kl_in_reward"][0] for h in halves])
    torch.testing.assert_close(rewards, whole["kl_in_reward"][0], atol=1e-6, rtol=0)
    for half in halves:  # every rank gets the whole batch's mean, not its own half's
        assert abs(half["kl_in_reward"][1] - whole["kl_in_reward"][1]) <= 1e-6
    # the halves differ (else the sums over ranks prove nothing): each half whitened alone gives other numbers
    alone = compute({k: v[:8] for k, v in whole_batch().items()}, None)
    assert (alone["gae"][0] - halves[0]["gae"][0]).abs().max() > 1e-3
