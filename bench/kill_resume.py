"""Kill a run at random moments, several times in a row (also in the middle of checkpoint writes), resume it with
the same command each time, and check that it ends with the uninterrupted run's weights and metrics.

    python bench/kill_resume.py                  # a tiny model and task made here, 4 kills
    python bench/kill_resume.py --kills 8 --seed 1

The run is `python grpo.py` on a tiny random Qwen2 with a checkpoint every step (`--ckpt-every 1`), so kills land
in generation, updates, evaluation and checkpoint writes alike. The same command (with `--overwrite`, which only
matters when a kill came before the first checkpoint) resumes from `checkpoints/latest` each time. Prints each
kill's moment and what it interrupted, then the largest weight difference and whether the metrics agree; exits 1
when they differ.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data.arith import ArithConfig, write_parquet  # noqa: E402
from sft import SFTConfig  # noqa: E402
from tiny import build_byte_tokenizer, build_tiny_qwen2  # noqa: E402

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"


@dataclass
class Args:
    kills: int = 4
    """Kills before the run is let finish (each in a later step than the one before)."""
    seed: int = 0
    """Seed of the kill moments."""
    steps: int = 8
    """RL steps of the run."""
    out_dir: str = "out/bench_kill_resume"
    """Where the model, the task and the two runs go."""


def setup(root: str) -> list[str]:
    """The tiny policy, task and reward on disk; returns grpo.py's arguments for them."""
    tokenizer = build_byte_tokenizer()
    model = build_tiny_qwen2(tokenizer, SFTConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                                  intermediate_size=128))
    model.save_pretrained(os.path.join(root, "model"))
    tokenizer.save_pretrained(os.path.join(root, "model"))
    train, val = write_parquet(ArithConfig(out_dir=os.path.join(root, "data"), n_train=512, n_val=16))
    with open(os.path.join(root, "reward.py"), "w") as f:
        f.write(REWARD)
    return [f"--model-path={root}/model", f"--train-files={train}", f"--val-files={val}",
            f"--reward-fn-path={root}/reward.py", "--train-batch-size=8", "--ppo-mini-batch-size=4", "--rollout-n=4",
            "--max-response-length=6", "--lr=3e-3", "--eval-every=4", "--ckpt-every=1", "--overwrite"]


def start(argv: list[str], out: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "grpo.py"), *argv, f"--out-dir={out}"], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def progress(out: str) -> tuple[int, list[str]]:
    """(the last step the run logged, checkpoint folders being written)."""
    metrics, ckpts = os.path.join(out, "metrics.jsonl"), os.path.join(out, "checkpoints")
    logged = sum(1 for _ in open(metrics)) - 1 if os.path.isfile(metrics) else -1  # step 0's line comes first
    return logged, [d for d in os.listdir(ckpts) if d.endswith(".tmp")] if os.path.isdir(ckpts) else []


def wait_for(out: str, step: int, mid_write: bool, proc: subprocess.Popen) -> None:
    """Block until the run has logged `step` (and, with mid_write, a checkpoint write is under way after it)."""
    while proc.poll() is None:
        logged, writing = progress(out)
        if logged >= step and (not mid_write or writing):
            return
        time.sleep(0.01)
    raise RuntimeError(f"the run ended before step {step}: see its log")


def final(out: str) -> tuple[dict, list]:
    from safetensors.torch import load_file

    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    keep = ("step", "critic/score/mean", "actor/pg_loss", "val/accuracy")
    return load_file(os.path.join(out, "final", "model.safetensors")), [{k: r.get(k) for k in keep} for r in records]


def main(args: Args):
    root = os.path.abspath(args.out_dir)
    os.makedirs(root, exist_ok=True)
    argv = setup(root) + [f"--total-steps={args.steps}"]
    whole, broken = os.path.join(root, "whole"), os.path.join(root, "broken")
    with open(os.path.join(root, "whole.log"), "w") as log:
        assert start(argv, whole, log).wait() == 0, "the uninterrupted run failed: see whole.log"
    rng = random.Random(args.seed)
    per_step = min(json.loads(line)["timing_s/step"] for line in list(open(f"{whole}/metrics.jsonl"))[1:])
    targets = sorted(rng.sample(range(1, args.steps), min(args.kills, args.steps - 1)))  # steps to kill in
    with open(os.path.join(root, "broken.log"), "w") as log:
        for kill, target in enumerate(targets):
            proc = start(argv, broken, log)
            mid_write = kill % 2 == 1  # every other kill waits for a checkpoint write in progress
            wait_for(broken, target, mid_write, proc)
            time.sleep(0 if mid_write else rng.uniform(0, per_step))  # somewhere in the next step
            logged, writing = progress(broken)
            os.killpg(proc.pid, signal.SIGKILL)
            what = f"after step {logged} was logged" + (f", while {writing[0]} was being written" if writing else "")
            proc.wait()
            ckpts = os.path.join(broken, "checkpoints")
            latest = open(os.path.join(ckpts, "latest")).read() if os.path.isfile(f"{ckpts}/latest") else "none"
            print(f"kill {kill + 1}: {what}; latest checkpoint after the kill: {latest}")
        assert start(argv, broken, log).wait() == 0, "the resumed run failed: see broken.log"
    (wa, ra), (wb, rb) = final(whole), final(broken)
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"final weights: max abs difference {diff:.3g}; metrics {'equal' if ra == rb else 'DIFFERENT'}")
    sys.exit(0 if diff == 0 and ra == rb else 1)


if __name__ == "__main__":
    main(tyro.cli(Args))
