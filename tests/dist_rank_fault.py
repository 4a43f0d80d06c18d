"""grpo.py under torchrun with a fault injected: one rank exits hard (os._exit) or hangs at the start of a step.
Run by tests/test_spmd.py; without NANOVERL_FAULT it is grpo.py.

    NANOVERL_FAULT=1:2:exit torchrun --nproc_per_node=2 tests/dist_rank_fault.py --out-dir out/f   # rank 1, step 2
"""

import os
import sys
import time

import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppo  # noqa: E402
from config import Config  # noqa: E402


def faulty(rl_step, rank: int, step: int, mode: str):
    def step_fn(at: int, *args, **kwargs):
        if at == step and int(os.environ["RANK"]) == rank:
            print(f"[fault injection] rank {rank}: {mode} at step {step}", flush=True)
            if mode == "exit":
                os._exit(1)
            time.sleep(10**9)
        return rl_step(at, *args, **kwargs)
    return step_fn


if __name__ == "__main__":
    if os.environ.get("NANOVERL_FAULT"):
        rank, step, mode = os.environ["NANOVERL_FAULT"].split(":")
        ppo.rl_step = faulty(ppo.rl_step, int(rank), int(step), mode)  # loop() looks rl_step up at each step
    ppo.train(tyro.cli(Config, default=Config(adv_estimator="grpo", out_dir="out/grpo")))
