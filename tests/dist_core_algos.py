"""Run by tests/test_core_algos.py under torchrun (2 ranks, gloo): every rank computes core_algos' functions on its
half of a batch, summing statistics over the ranks (comm.all_sum_fn), and saves its results.

    torchrun --nproc_per_node=2 tests/dist_core_algos.py OUT_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from comm import all_sum_fn, init_distributed, shutdown  # noqa: E402
from core_algos import compute_advantages, kl_in_reward, masked_whiten  # noqa: E402

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
N, GROUPS, R = 4, 4, 6  # samples per prompt, prompts, response tokens


def whole_batch() -> dict:
    """A step's batch as the step builds it (float32, ragged responses, scores on the last token, prompt groups)."""
    g = torch.Generator().manual_seed(0)
    B = N * GROUPS
    lengths = torch.randint(1, R + 1, (B,), generator=g)  # [B]
    mask = (torch.arange(R) < lengths[:, None]).float()  # [B, R]
    scores = torch.randint(0, 3, (B,), generator=g).float() / 2  # [B]
    token_rewards = torch.zeros(B, R)
    token_rewards[torch.arange(B), lengths - 1] = scores
    return dict(token_level_rewards=token_rewards, response_mask=mask, scores=scores,
                group=torch.arange(GROUPS).repeat_interleave(N), values=torch.randn(B, R, generator=g) * mask,
                logp=-torch.rand(B, R, generator=g) * 3, ref_logp=-torch.rand(B, R, generator=g) * 3)


def compute(batch: dict, all_sum) -> dict:
    """Every estimator's advantages and returns, whitening, and the in-reward KL (rewards and the batch's mean)."""
    out = {}
    fields = {k: batch[k] for k in ("token_level_rewards", "response_mask", "scores", "group", "values")}
    for name in ESTIMATORS:
        out[name] = compute_advantages(name, **fields, gamma=0.9, lam=0.8, all_sum=all_sum)
    out["whiten"] = masked_whiten(batch["values"], batch["response_mask"], all_sum)
    out["kl_in_reward"] = kl_in_reward(batch["token_level_rewards"], batch["logp"], batch["ref_logp"],
                                       batch["response_mask"], 0.1, "k3", all_sum)
    return out


def shard(batch: dict, rank: int, ranks: int) -> dict:
    """Rank's contiguous half; group ids count from 0 on every rank (as the step numbers a rank's groups)."""
    rows = len(batch["scores"]) // ranks
    out = {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}
    out["group"] = out["group"] - out["group"].min()
    return out


if __name__ == "__main__":
    dist = init_distributed(timeout_s=120)
    result = compute(shard(whole_batch(), dist.dp_rank, dist.dp_size), all_sum_fn(dist))
    torch.save(result, os.path.join(sys.argv[1], f"rank{dist.rank}.pt"))
    shutdown(dist)
