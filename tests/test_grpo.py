"""End-to-end GRPO through ppo.py's loop, with the real in-process vLLM engine:

    python -m pytest tests/test_grpo.py -q

A tiny random policy learns a dense custom reward (the share of digits in its response): mean reward
of the last steps must clearly exceed the first steps'. The same run checks what a run leaves behind. RLOO and
REINFORCE++ learn it too, and a sync that the verification rejects stops a run.
"""

import json
import os

import pytest
from conftest import assert_reward_rises, toy_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hybrid_engine import HybridConfig
from ppo import train


@pytest.fixture(scope="module")
def run(tiny_rl_setup, tmp_path_factory):
    cfg = toy_config(**tiny_rl_setup, train_batch_size=16, ppo_mini_batch_size=8, rollout_n=8, max_response_length=6,
                     lr=3e-3, total_steps=16, eval_every=8, out_dir=str(tmp_path_factory.mktemp("grpo") / "out"),
                     adv_estimator="grpo", logger=("tensorboard",),
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
                "rollout/logprob_diff_mean", "reshard/bytes", "reshard/buckets", "perf/max_memory_gb/reshard",
                "reshard/max_memory_extra_gb", "reshard/probe_logprob_diff_max"}
    for r in lines[1:]:
        assert expected <= r.keys(), expected - r.keys()
        assert r["reshard/buckets"] == 4 and r["reshard/bytes"] > 0  # one layer a bucket: 2 + embedding + norm
    assert [r["step"] for r in lines if "val/accuracy" in r] == [0, 8, 16]
    # vLLM samples with the weights the trainer holds: the log-prob gap stays at float rounding
    assert max(r["rollout/logprob_diff_max"] for r in lines[1:]) < 1e-3
    assert os.path.getsize(os.path.join(cfg.out_dir, "curves.png")) > 1000
    assert os.path.exists(os.path.join(cfg.out_dir, "final", "model.safetensors"))
    events = EventAccumulator(os.path.join(cfg.out_dir, "tensorboard"))  # --logger tensorboard: every step's rows
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == \
        [(r["step"], pytest.approx(r["critic/score/mean"])) for r in lines[1:]]


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus"])
def test_other_critic_free_estimators_learn(tiny_rl_setup, tmp_path, estimator):
    """RLOO (leave-one-out baseline) and REINFORCE++ (whitened returns) learn the same reward end to end."""
    cfg = toy_config(**tiny_rl_setup, train_batch_size=16, ppo_mini_batch_size=8, rollout_n=8, max_response_length=6,
                     lr=3e-3, total_steps=16, eval_every=16, out_dir=str(tmp_path / "out"), adv_estimator=estimator)
    assert_reward_rises(train(cfg))


def test_a_sync_beyond_verify_tol_stops_the_run(tiny_rl_setup, tmp_path):
    """The loop's weight syncs are verified for real: a tolerance below the engine/trainer rounding gap (a few
    1e-6 in fp32) makes the first sync fail, and the run stops with the probe's message."""
    cfg = toy_config(**tiny_rl_setup, total_steps=1, out_dir=str(tmp_path),
                     hybrid=HybridConfig(verify_sync=True, verify_tol=1e-12))
    with pytest.raises(RuntimeError, match=r"(?s)the engine's probe log-probs differ .*verify_tol=1e-12"):
        train(cfg)
