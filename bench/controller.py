"""Seconds per step of the Ray single controller against torchrun on the same 2-worker GRPO run, and the bytes the
driver moves per step, printed side by side.

    OMP_NUM_THREADS=1 python bench/controller.py     # the default task (built-in warm start), 2 workers, 30 steps
    python bench/controller.py --steps 10 --warmup 3 --repeats 1

Each controller runs `--steps` steps of the default GRPO configuration from the same warm start (torchrun: `torchrun
--nproc_per_node=2 grpo.py`, one rank a core; Ray: `python ray_trainer.py`, one 1-CPU worker a core and the driver
beside them), evaluating only at the end. The figures are the mean and median of timing_s/step over the steps after
`--warmup` (the first steps pay for allocations and the engine's first calls), read from each run's metrics.jsonl.
The two controllers take turns (`--repeats` rounds of torchrun then Ray), and each one's figures are over all its
rounds: a 2-core machine drifts by 10-20% between runs a few minutes apart, which one round each would mistake for
a difference of the controllers.
"""

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    steps: int = 30
    """RL steps per controller."""
    warmup: int = 5
    """Steps left out of the means."""
    repeats: int = 2
    """Rounds of (torchrun, Ray), taking turns."""
    out_dir: str = "out/bench_controller"
    """Where the two runs write."""


def run(name: str, cmd: list[str], args: Args) -> list[dict]:
    out = os.path.join(args.out_dir, name)  # each round overwrites the last's folder (resume off)
    flags = [f"--total-steps={args.steps}", f"--eval-every={args.steps}", f"--out-dir={out}", "--resume=off",
             "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    with open(os.path.join(args.out_dir, f"{name}.log"), "w") as log:
        subprocess.run(cmd + flags, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1 + args.warmup :]


def main(args: Args):
    os.makedirs(args.out_dir, exist_ok=True)
    cmds = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "grpo.py"],
            "ray": [sys.executable, "ray_trainer.py", "--ray.workers=2"]}
    runs = {name: [] for name in cmds}
    for _ in range(args.repeats):
        for name, cmd in cmds.items():
            runs[name] += run(name, cmd, args)
    base = statistics.mean(r["timing_s/step"] for r in runs["torchrun"])
    print(f"{args.repeats} rounds of {args.steps} steps each, the last {args.steps - args.warmup} of each measured")
    print(f"{'controller':<10} {'s/step mean':>12} {'median':>8} {'gen':>7} {'update':>7} {'driver MB/step':>15} "
          f"{'vs torchrun':>12}")
    for name, records in runs.items():
        steps = [r["timing_s/step"] for r in records]
        moved = statistics.mean(r.get("ray/driver_bytes", 0.0) for r in records) / 2**20
        gen, update = (statistics.mean(r[k] for r in records) for k in ("timing_s/gen", "timing_s/update_actor"))
        print(f"{name:<10} {statistics.mean(steps):>12.3f} {statistics.median(steps):>8.3f} {gen:>7.3f} {update:>7.3f} "
              f"{moved:>15.2f} {statistics.mean(steps) / base:>11.2f}x")


if __name__ == "__main__":
    main(tyro.cli(Args))
