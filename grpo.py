"""GRPO and the other group estimators (RLOO), and the GRPO entry point over ppo.py's loop, with no critic.

    python grpo.py                                   # built-in tiny policy + arithmetic task, CPU
    python grpo.py --rollout-n 8 --lr 2e-4 --total-steps 60  # any field of ppo.Config
    python grpo.py --no-norm-adv-by-std --loss-agg-mode seq-mean-token-sum-norm   # Dr.GRPO
    python grpo.py --adv-estimator rloo             # RLOO (also reinforce_plus_plus, reinforce_plus_plus_baseline)
    python grpo.py --model-path PATH --train-files train.parquet --val-files val.parquet

Each prompt is sampled n times; a response's advantage is its reward minus its group's mean, divided by
the group's std (GRPO, Shao et al. 2024) or not (Dr.GRPO, Liu et al. 2025), the same for every token.
ppo.py imports the estimators from here (its ADVANTAGE_ESTIMATORS), so this file imports ppo only to run. They
take ppo.py's (batch, cfg, dist) and leave dist alone: a prompt's group never spans dp ranks.
"""

from typing import TYPE_CHECKING

import torch
import tyro
from tensordict import TensorDict

if TYPE_CHECKING:
    from comm import Dist
    from ppo import Config


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


def grpo_advantages(batch: TensorDict, cfg: "Config", dist: "Dist") -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence advantage broadcast over response tokens: (advantages, returns) [B, R], the two the same."""
    adv = group_advantages(batch["scores"], batch["group"], cfg.norm_adv_by_std)  # [B]
    adv = adv.unsqueeze(-1) * batch["response_mask"]  # [B, R]
    return adv, adv


def rloo_advantages(batch: TensorDict, cfg: "Config", dist: "Dist") -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): a response's reward minus the mean reward of the other n - 1 responses to its
    prompt, for every token: (advantages, returns) [B, R], the two the same. A group of one keeps its raw reward."""
    scores, group = batch["scores"], batch["group"]  # [B] each
    count = torch.zeros(int(group.max()) + 1).index_add_(0, group, torch.ones_like(scores))  # [G]
    total = torch.zeros_like(count).index_add_(0, group, scores)  # [G]
    others = (total[group] - scores) / (count[group] - 1).clamp(min=1)  # [B], the leave-one-out baseline
    adv = (scores - others).unsqueeze(-1) * batch["response_mask"]  # [B, R]
    return adv, adv


if __name__ == "__main__":
    from ppo import Config, train

    train(tyro.cli(Config, default=Config(adv_estimator="grpo", out_dir="out/grpo")))
