"""DPO (Rafailov et al., 2023) and IPO on preference pairs: reward_model.py's trainer, where the reward is the policy's
own log-ratio to a frozen copy of itself, beta * (log pi(y|x) - log pi_ref(y|x)): the offline baseline to RL.

    python dpo.py                                      # the built-in RLHF task's pairs, from its warm start
    python grpo.py --model-path out/dpo --total-steps 1  # its held-out accuracy (step 0), as RL measures it
    python dpo.py --model-path out/sft --train-files pairs.parquet --val-files pairs_val.parquet --out-dir out/dpo
    python dpo.py ... --loss ipo                       # IPO: a squared loss on the token-mean log-ratios
    torchrun --nproc_per_node=2 dpo.py ...             # FSDP2 over 2 ranks (the reference sharded the same way)

The metrics are TRL's (rewards/chosen|rejected|accuracies|margins, logps/chosen|rejected; eval_ for held-out pairs).
"""

from dataclasses import dataclass
from typing import Literal

import tyro

from reward_model import PreferenceConfig, run


@dataclass
class DPOConfig(PreferenceConfig):
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta * margin of log-ratios); ipo: (margin - 1 / (2 beta))^2."""
    out_dir: str = "out/dpo"
    """Where the kept policy goes (a plain HF folder), with preference_result.json and metrics.jsonl."""
    lr: float = 1e-6
    """AdamW learning rate (TRL's DPO default; constant after the warm-up)."""


if __name__ == "__main__":
    run(tyro.cli(DPOConfig, description="DPO on prompt / chosen / rejected pairs. All fields:"))
