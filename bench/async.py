"""Generation and training at the same time: synchronous colocated, synchronous split, and one-step-off, on the same
work (model, batch, steps, devices), side by side in one run, with the ideal overlapped time.

    python bench/async.py                                # both sizes (~5 min on 2 cores)
    python bench/async.py --sizes default --steps 3      # one quick size

Devices: on CPU each worker is bound to a core of its own (ray.pin_cores), so two workers are two devices.
  colocated      two workers, each with the actor, its engine (the hybrid engine) and half the batch
  split          one trainer worker and one generation-only engine (async.rollout_workers 1), staleness 0: each
                 batch waits for the previous update's weights
  one-step-off   the same pools, staleness 1: batch k+1 generates while the trainer updates on batch k
  staleness 2    refused by config.AsyncConfig, whose message is printed: the pool takes new weights only between
                 requests, after every batch already started, so it would add staleness and no overlap
Sizes: "default" is python grpo.py's run (the 1M-parameter warm start, 32 prompts x 8, a few tokens each: the
trainer's work is about twice the generation's); "gen" is generation-bound: the same policy, 8 prompts x 4, every
response forced to 256 tokens (--ignore-eos), one optimizer step a step (bench/step.py's 25M "gen" size is
update-bound on CPU: its update takes twice its generation). Every mode recomputes the old log-probs (the same
work; one-step-off needs them: its samples are one update old).

Printed per size and mode: s/step (mean of the steps after the first), each pool's bubble (idle share of the
step, perf/bubble/*), and the distance to the ideal overlapped step: from the split run, the larger of the two
pools' busy time (perf/busy_s/*: generation, scoring's wait and sync on one side, the trainer's passes and sync
on the other), which a perfect overlap of the two could not beat.
"""

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules

import ray  # noqa: E402
import tyro  # noqa: E402

from config import AsyncConfig, Config  # noqa: E402
from ray_trainer import ROOT, RayConfig, RayTrainerConfig, train  # noqa: E402


@dataclass
class BenchConfig:
    sizes: tuple[str, ...] = ("default", "gen")
    """default (python grpo.py's run) and/or gen (the same policy, generation-bound: 256-token responses)."""
    steps: int = 6
    """RL steps per mode; the first is left out of the means (start-up, first sync)."""
    out_dir: str = "out/bench_async"
    """Where the runs' files go."""


MODES = {  # name: (Ray workers, rollout pool workers, staleness)
    "colocated": (2, 0, 0),
    "split": (1, 1, 0),
    "one-step-off": (1, 1, 1),
}


def run_mode(size: str, mode: str, bench: BenchConfig) -> list[dict]:
    workers, pool, staleness = MODES[mode]
    cfg = Config(adv_estimator="grpo", out_dir=os.path.join(bench.out_dir, size, mode), overwrite=True,
                 total_steps=bench.steps, eval_every=10**6, old_log_probs="recompute",
                 async_=AsyncConfig(rollout_workers=pool, staleness=staleness))
    if size == "gen":
        cfg = replace(cfg, train_batch_size=8, ppo_mini_batch_size=8, rollout_n=4, max_response_length=256,
                      ignore_eos=True)
    records = train(RayTrainerConfig(cfg, RayConfig(workers=workers, cpus_per_worker=1, pin_cores=True)))
    return [r for r in records if r["step"] >= 2]


def mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else None


def report(size: str, runs: dict[str, list[dict]]) -> None:
    split = runs["split"]
    ideal = sum(max(r["perf/busy_s/actor"], r["perf/busy_s/rollout"]) for r in split) / len(split)
    gen, train_s = mean(split, "perf/busy_s/rollout"), mean(split, "perf/busy_s/actor")
    colocated = mean(runs["colocated"], "timing_s/step")
    print(f"\n{size}: split run's busy time per step: rollout pool {gen:.3f} s, trainer {train_s:.3f} s -> ideal "
          f"overlapped step {ideal:.3f} s")
    print(f"{'mode':<14} {'s/step':>8} {'bubble trainer':>15} {'bubble rollout':>15} {'/ ideal':>8} {'/ colocated':>12}")
    for mode, records in runs.items():
        step = mean(records, "timing_s/step")
        rollout = mean(records, "perf/bubble/rollout")
        print(f"{mode:<14} {step:>8.3f} {mean(records, 'perf/bubble/actor'):>15.2f} "
              f"{'-' if rollout is None else f'{rollout:.2f}':>15} {step / ideal:>8.2f} {step / colocated:>12.2f}")


def main(bench: BenchConfig) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]}})
    for size in bench.sizes:
        runs = {mode: run_mode(size, mode, bench) for mode in MODES}
        print(f"\nGRPO steps on {os.cpu_count()} CPU cores, one a worker; means of steps 2..{bench.steps}")
        report(size, runs)
    try:
        AsyncConfig(rollout_workers=1, staleness=2)
    except ValueError as refused:
        print(f"\nstaleness 2 (split pools): refused: {refused}")


if __name__ == "__main__":
    main(tyro.cli(BenchConfig))
