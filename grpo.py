"""The GRPO entry point: ppo.py's step and loop with GRPO's defaults (group advantages, no critic).

    python grpo.py                                   # built-in tiny policy + arithmetic task, CPU
    python grpo.py --rollout-n 8 --lr 2e-4 --total-steps 60  # any field of config.Config
    python grpo.py --no-norm-adv-by-std --loss-agg-mode seq-mean-token-sum-norm   # Dr.GRPO
    python grpo.py --adv-estimator rloo             # RLOO (also reinforce_plus_plus, reinforce_plus_plus_baseline)
    python grpo.py --model-path PATH --train-files train.parquet --val-files val.parquet

Each prompt is sampled n times; a response's advantage, the same for every token, is its reward minus its group's
mean, divided by the group's std (GRPO, Shao et al. 2024) or not (Dr.GRPO, Liu et al. 2025); RLOO's baseline is the
mean of the other n - 1 rewards. No critic; the loss is PPO's clipped surrogate (+ --use-kl-loss). The estimators
are in core_algos.py beside PPO's, as the one step (ppo.rl_step) picks any by name; a group never spans dp ranks.
"""

import tyro

from config import START_HERE, Config
from ppo import train

if __name__ == "__main__":
    help_text = START_HERE.format(script="grpo.py", algo="GRPO", name="grpo")
    train(tyro.cli(Config, default=Config(adv_estimator="grpo", out_dir="out/grpo"), description=help_text))
