"""End-to-end GRPO through ppo.py's loop, with the real in-process vLLM engine:

    python -m pytest tests/test_grpo.py -q

A tiny random policy learns a dense custom reward (the share of digits in its response): mean reward
of the last steps must clearly exceed the first steps'. The same run checks what a run leaves behind.
"""

import json
import os

import pytest
from conftest import assert_reward_rises

from hybrid_engine import HybridConfig
from ppo import Config, train


@pytest.fixture(scope="module")
def run(tiny_rl_setup, tmp_path_factory):
    cfg = Config(**tiny_rl_setup, train_batch_size=16, ppo_mini_batch_size=8, rollout_n=8, max_response_length=6, lr=3e-3,
                 total_steps=16, eval_every=8, out_dir=str(tmp_path_factory.mktemp("grpo") / "out"), adv_estimator="grpo",
                 hybrid=HybridConfig(verify_sync=True))  # every sync proven (raises otherwise)
    return cfg, train(cfg)


def test_reward_rises(run):
    assert_reward_rises(run[1])


def test_run_outputs(run):
    cfg, records = run
    lines = [json.loads(line) for line in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]
    assert lines == records and [r["step"] for r in lines] == list(range(cfg.total_steps + 1))
    expected = {"timing_s/gen", "timing_s/update_actor", "timing_s/reshard", "timing_s/step",
                "perf/throughput", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
                "actor/grad_norm", "critic/score/mean", "response_length/mean", "rollout/logprob_diff_max",
                "rollout/logprob_diff_mean", "reshard/bytes", "reshard/buckets", "perf/max_memory_rss_gb",
                "reshard/max_memory_extra_gb", "reshard/probe_logprob_diff_max"}
    for r in lines[1:]:
        assert expected <= r.keys(), expected - r.keys()
        assert r["reshard/buckets"] == 1 and r["reshard/probe_logprob_diff_max"] <= 1e-4
    assert [r["step"] for r in lines if "val/accuracy" in r] == [0, 8, 16]
    # vLLM samples with the weights the trainer holds: the log-prob gap stays at float rounding
    assert max(r["rollout/logprob_diff_max"] for r in lines[1:]) < 1e-3
    assert os.path.getsize(os.path.join(cfg.out_dir, "curves.png")) > 1000
    assert os.path.exists(os.path.join(cfg.out_dir, "final", "model.safetensors"))
