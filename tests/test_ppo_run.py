"""End-to-end PPO with a critic through ppo.py's loop, with the real in-process vLLM engine:

    python -m pytest tests/test_ppo_run.py -q

A tiny random policy learns a dense custom reward (the share of digits in its response) with GAE on a critic,
a critic warm-up and an adaptive in-reward KL penalty. The same run checks the loop's order (the actor waits
for the warm-up), the KL controller's recursion across steps, the metrics and what the run leaves behind.
"""

import json
import os
from dataclasses import replace

import pytest
from safetensors.torch import load_file
from conftest import assert_reward_rises, toy_config

from core_algos import update_kl_coef
from ppo import train

WARMUP = 2


@pytest.fixture(scope="module")
def run(tiny_rl_setup, tmp_path_factory):
    cfg = toy_config(**tiny_rl_setup, train_batch_size=16, ppo_mini_batch_size=8, rollout_n=8, max_response_length=6,
                 lr=3e-3, critic_lr=3e-3, critic_warmup=WARMUP, use_kl_in_reward=True, kl_ctrl_type="adaptive",
                 kl_coef=0.01, kl_target=0.01, kl_horizon=400, total_steps=16, eval_every=8,
                 out_dir=str(tmp_path_factory.mktemp("ppo") / "out"))
    return cfg, train(cfg)


def test_reward_rises(run):
    assert_reward_rises(run[1])


def test_critic_warmup_then_both_update(run):
    _, records = run
    for r in records[1:]:
        assert "critic/vf_loss" in r and "critic/grad_norm" in r, r["step"]
        assert ("actor/pg_loss" in r) == (r["step"] > WARMUP), r["step"]


def test_adaptive_kl_coefficient_follows_the_controller(run):
    cfg, records = run
    steps = records[1:]
    assert steps[0]["actor/reward_kl_penalty_coeff"] == cfg.kl_coef
    assert steps[0]["actor/reward_kl_penalty"] == 0.0  # the policy is the reference until the first actor update
    for before, after in zip(steps, steps[1:]):
        expected = update_kl_coef(before["actor/reward_kl_penalty_coeff"], before["actor/reward_kl_penalty"],
                                  cfg.train_batch_size * cfg.rollout_n, cfg.kl_ctrl_type, cfg.kl_target,
                                  cfg.kl_horizon)
        assert after["actor/reward_kl_penalty_coeff"] == pytest.approx(expected, rel=1e-12)
    coeffs = [r["actor/reward_kl_penalty_coeff"] for r in steps]
    assert coeffs[1] < coeffs[0], "no KL during the warm-up (under the target): the coefficient falls"
    assert any(b > a for a, b in zip(coeffs, coeffs[1:])), "a KL above the target: the coefficient rises"


def test_run_outputs(run):
    cfg, records = run
    lines = [json.loads(line) for line in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]
    assert lines == records and [r["step"] for r in lines] == list(range(cfg.total_steps + 1))
    expected = {"critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/advantages/mean",
                "critic/returns/mean", "critic/vf_explained_var", "critic/grad_norm", "critic/lr",
                "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "actor/pg_clipfrac_lower",
                "timing_s/values", "timing_s/update_critic", "timing_s/ref"}
    for r in lines[WARMUP + 1 :]:
        assert expected <= r.keys(), expected - r.keys()
    assert abs(lines[-1]["critic/advantages/mean"]) < 1e-5  # whitened over the batch
    assert [r["step"] for r in lines if "val/accuracy" in r] == [0, 8, 16]
    assert os.path.exists(os.path.join(cfg.out_dir, "final", "model.safetensors"))
    assert os.path.exists(os.path.join(cfg.out_dir, "critic", "model.safetensors"))


def test_critic_starts_from_critic_model_path(run, tmp_path):
    """A run given critic_model_path (the trained critic this run exported, value head included) starts its critic
    there: at a critic_lr far below fp32 resolution, one step exports that critic unchanged."""
    cfg, _ = run
    trained_dir = os.path.join(cfg.out_dir, "critic")
    follow = replace(cfg, critic_model_path=trained_dir, critic_lr=1e-30, critic_warmup=0, total_steps=1,
                     eval_every=1, out_dir=str(tmp_path))
    train(follow)
    trained = load_file(os.path.join(trained_dir, "model.safetensors"))
    exported = load_file(os.path.join(tmp_path, "critic", "model.safetensors"))
    assert exported.keys() == trained.keys() and "score.weight" in trained
    for name, weight in trained.items():
        assert (exported[name] - weight).abs().max() <= 1e-6, name
    fresh = load_file(os.path.join(cfg.model_path, "model.safetensors"))  # what a critic from the policy would hold
    name = "model.layers.0.mlp.up_proj.weight"
    assert (trained[name] - fresh[name]).abs().max() > 1e-3, "the trained critic must differ from the policy"
