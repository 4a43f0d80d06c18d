"""GRPO: group-relative advantages on top of ppo.py's loop, with no critic.

    python grpo.py                                   # built-in tiny policy + arithmetic task, CPU
    python grpo.py --rollout-n 8 --lr 2e-4 --total-steps 60  # any field of ppo.Config
    python grpo.py --no-norm-adv-by-std --loss-agg-mode seq-mean-token-sum-norm   # Dr.GRPO
    python grpo.py --model-path PATH --train-files train.parquet --val-files val.parquet

Each prompt is sampled n times; a response's advantage is its reward minus its group's mean, divided by
the group's std (GRPO, Shao et al. 2024) or not (Dr.GRPO, Liu et al. 2025), the same for every token.
"""

import torch
import tyro
from tensordict import TensorDict

from ppo import Config, train


def group_advantages(scores: torch.Tensor, group: torch.Tensor, norm_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantage [B] from rewards [B] and group ids [B].

    A group whose rewards are all equal gets advantage 0 (nothing to prefer). A group of one response
    keeps its raw reward, as verl does (mean 0, std 1).
    """
    n_groups = int(group.max()) + 1
    count = torch.zeros(n_groups).index_add_(0, group, torch.ones_like(scores))  # [G]
    mean = torch.zeros(n_groups).index_add_(0, group, scores) / count  # [G]
    sq_dev = torch.zeros(n_groups).index_add_(0, group, (scores - mean[group]).square())
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()  # [G], unbiased like torch.std
    # Equal rewards must give exactly 0: the float mean of 3 x 0.9 misses 0.9 by an ulp, and dividing
    # that by a std of the same size would turn it into a sizeable advantage.
    top = torch.full((n_groups,), -torch.inf).scatter_reduce(0, group, scores, "amax")  # [G]
    low = torch.full((n_groups,), torch.inf).scatter_reduce(0, group, scores, "amin")  # [G]
    single = count == 1
    centred = torch.where(single[group], scores, scores - mean[group])  # [B]
    centred = torch.where((top == low)[group] & ~single[group], 0.0, centred)
    return centred / (torch.where(single, 1.0, std)[group] + eps) if norm_by_std else centred


def grpo_advantages(batch: TensorDict, cfg: Config) -> torch.Tensor:
    """The sequence advantage broadcast over response tokens: [B, R]."""
    adv = group_advantages(batch["scores"], batch["group"], cfg.norm_adv_by_std)  # [B]
    return adv.unsqueeze(-1) * batch["response_mask"]


if __name__ == "__main__":
    train(tyro.cli(Config), grpo_advantages)
