"""A new user's task end to end, as the README's "Your own data" walks it: an SFT parquet with its own response
column, RL parquets with their own data_source, a reward file; warm start with sft.py, then GRPO from the folder
sft.py wrote.

    python -m pytest tests/test_own_task.py -q

The task: write a 3-letter word in capitals ("cat" -> "CAT"). The user's SFT data comes from a sloppy teacher that
answers in capitals only 40% of the time (else it copies the word), so the warm start answers some words right
when greedy and the rest right now and then when sampling; the reward (the exact capitals) lets GRPO select the
right habit, and accuracy on held-out words (never in the SFT or RL training data) rises.
"""

import json
import os
import random
from dataclasses import replace

import pandas as pd
from conftest import TINY, toy_config

from ppo import train as train_rl
from sft import run as run_sft

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "my/upper", data_source
    return float(solution_str.strip() == ground_truth)
'''


def write_task(root: str) -> dict:
    """The user's files: sft.parquet (columns question, target), train/val.parquet in verl's RL schema, reward.py."""
    rng = random.Random(0)
    words = lambda n: {"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3)) for _ in range(n)}  # noqa
    val = sorted(words(100))
    train = sorted(words(4000) - set(val))
    pd.DataFrame({"question": train, "target": [w.upper() if rng.random() < 0.4 else w for w in train]}).to_parquet(
        os.path.join(root, "sft.parquet"))
    for name, rows in (("train", train), ("val", val)):
        pd.DataFrame([{"data_source": "my/upper", "prompt": [{"role": "user", "content": w}], "ability": "text",
                       "reward_model": {"style": "rule", "ground_truth": w.upper()}, "extra_info": {"index": i}}
                      for i, w in enumerate(rows)]).to_parquet(os.path.join(root, f"{name}.parquet"))
    with open(os.path.join(root, "reward.py"), "w") as f:
        f.write(REWARD)
    return {k: os.path.join(root, f) for k, f in (("sft", "sft.parquet"), ("train", "train.parquet"),
                                                  ("val", "val.parquet"), ("reward", "reward.py"))}


def test_own_task_warm_start_then_grpo(tmp_path):
    files = write_task(str(tmp_path))
    warm = str(tmp_path / "warm")
    sft = replace(TINY, train_files=files["sft"], val_files=files["val"], response_key="target",
                  reward_fn_path=files["reward"], out_dir=warm, batch_size=64, max_steps=300, eval_every=25,
                  stop_accuracy=0.0)
    assert run_sft(sft) == warm  # exactly the folder given
    result = json.load(open(os.path.join(warm, "sft_result.json")))
    assert 0.1 <= result["val/accuracy"] <= 0.9  # the habit: greedy is right on some held-out words, not most
    assert result["val/accuracy"] == max(h["val/accuracy"] for h in result["history"])  # the best one kept
    cfg = toy_config(model_path=warm, train_files=files["train"], val_files=files["val"],
                     reward_fn_path=files["reward"], adv_estimator="grpo", total_steps=10, eval_every=5,
                     out_dir=str(tmp_path / "rl"))  # grpo.py's run
    records = train_rl(cfg)
    accuracy = [r["val/accuracy"] for r in records if "val/accuracy" in r]  # steps 0, 5, 10
    # the RL run scores the warm start as sft.py did: the same reward dispatch (vLLM's greedy instead of HF's)
    assert abs(accuracy[0] - result["val/accuracy"]) <= 0.03, (accuracy[0], result["val/accuracy"])
    assert accuracy[-1] >= accuracy[0] + 0.2 and accuracy[-1] >= 0.8, accuracy
