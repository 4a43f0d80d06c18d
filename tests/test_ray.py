"""The Ray single controller (ray_trainer.py) against torchrun, and after failures, on a local Ray instance:

    python -m pytest tests/test_ray.py -q

- GRPO with 2 colocated workers gives torchrun's per-step rewards, losses and accuracies and its final weights, on
  multi-turn rows with a tool (agent.py); so does PPO with the critic in a pool of its own (split placement), a LoRA
  actor and an adaptive KL coefficient (against conftest.ppo_two_ranks, the torchrun run test_spmd.py uses too).
- A rollout pool of its own: with staleness 0 the colocated run's numbers, even when a trainer worker stops
  answering in its update: the groups and the pool are replaced, the run resumes from the latest checkpoint and
  ends with the uninterrupted run's metrics and weights; ray/restarts counts the restart.
- A worker that keeps dying stops the run after ray.max_restarts with an error that says so.
- One-step-off (HF engines) replaces a dead engine without restarting the trainer, and resumes after a trainer
  worker exits hard in its update.
"""

import json
import os
import time
from dataclasses import replace

import pytest
import ray
from safetensors.torch import load_file
from test_spmd import args, launch

from conftest import PPO_TWO_RANKS, toy_config
from config import AsyncConfig, Config
from ray_trainer import RayConfig, RayTrainerConfig, check, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
# what both controllers compute the same way (per-rank token means, such as critic/advantages/mean, and timings
# are averaged differently by torchrun's rank-mean and the driver's whole batch)
SAME = ("critic/score/mean", "critic/score/max", "critic/score/min", "actor/pg_loss", "actor/entropy", "actor/ppo_kl",
        "actor/grad_norm", "actor/pg_clipfrac", "response_length/mean", "critic/vf_loss", "critic/grad_norm",
        "critic/values/max", "critic/values/min", "val/accuracy", "global_seqlen/balanced_minmax_diff",
        "num_turns/mean", "tool_calls/mean", "tool_errors/mean", "val/tool_call_rate")


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}})
    yield
    ray.shutdown()


def config(setup: dict, out_dir, **overrides) -> Config:
    return toy_config(**{**setup, "train_batch_size": 8, "ppo_mini_batch_size": 4, "rollout_n": 4,
                         "max_response_length": 6, "lr": 3e-3, "eval_every": 2, "total_steps": STEPS,
                         "ckpt_every": 2, "adv_estimator": "grpo", "out_dir": str(out_dir), **overrides})


def records(out_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def assert_same_run(a, b, out_a, out_b, critic: bool = False):
    """Same steps, the same values of SAME within 1e-5, and the same final weights."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in SAME:
            assert (key in ra) == (key in rb), (ra["step"], key)
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], abs=1e-5), (ra["step"], key)
    for folder in ("final", "critic") if critic else ("final",):
        wa, wb = (load_file(os.path.join(d, folder, "model.safetensors")) for d in (out_a, out_b))
        assert wa.keys() == wb.keys()
        for name in wa:
            assert (wa[name] - wb[name]).abs().max() <= 1e-5, (folder, name)


@pytest.fixture(scope="module")
def grpo_runs(calling_setup, tmp_path_factory):
    """The same multi-turn GRPO run (a policy that calls a tool now and then: conftest.calling_setup) under torchrun
    (2 ranks) and under the Ray driver (2 colocated workers); the rollout pool tests below run it too."""
    torchrun, on_ray = tmp_path_factory.mktemp("torchrun"), tmp_path_factory.mktemp("ray_grpo")
    agent = calling_setup["agent"]
    flags = [f"--agent.{k.replace('_', '-')}={getattr(agent, k)}" for k in ("tools_path", "call_start", "call_end",
                                                                             "observation")]
    setup = {k: v for k, v in calling_setup.items() if k != "agent"}
    launch(args(setup, torchrun, total_steps=STEPS, ckpt_every=2, max_response_length=16) + flags, torchrun / "log",
           ranks=2)
    cfg = config(calling_setup, on_ray, max_response_length=16, hybrid=replace(Config().hybrid, verify_sync=True))
    return cfg, torchrun, train(RayTrainerConfig(cfg, RayConfig(workers=2)))


def test_ray_grpo_equals_torchrun(grpo_runs):
    """The Ray run of grpo_runs: torchrun's numbers and weights, tool calls in every step, no restart."""
    cfg, torchrun, ray_records = grpo_runs
    assert_same_run(records(torchrun), records(cfg.out_dir), torchrun, cfg.out_dir)
    assert ray_records == records(cfg.out_dir)
    assert all(r["tool_calls/mean"] > 0 for r in ray_records[1:]) and max(r["num_turns/max"] for r in ray_records[1:]) > 1
    assert all(r["ray/restarts"] == 0 and r["ray/driver_bytes"] > 0 for r in ray_records[1:])
    assert os.path.getsize(os.path.join(cfg.out_dir, "curves.png")) > 1000


def test_a_worker_that_keeps_dying_stops_the_run(tiny_rl_setup, tmp_path):
    """The worker (one, with HF generate: no engine to start) exits in the step-0 evaluation in every incarnation:
    after ray.max_restarts restarts the run stops with an error that counts the failures and names the last one."""
    rc = RayConfig(workers=1, fail_role="actor", fail_rank=0, fail_method="generate", fail_call=1, fail_times=5,
                   max_restarts=1)
    with pytest.raises(RuntimeError, match=r"workers kept failing: 2 failures, ray.max_restarts=1; the last before "
                                           r"step 1 completed: actor.generate: "
                                           r"rank 0 died"):
        train(RayTrainerConfig(config(tiny_rl_setup, tmp_path, rollout_backend="hf"), rc))


def test_rollout_tp_is_refused_by_name_on_the_ray_controller(tiny_rl_setup, tmp_path):
    """A tensor-parallel engine runs under torchrun (test_spmd.py); the driver refuses it before any worker starts."""
    for rc in (RayConfig(workers=2), RayConfig(workers=1)):
        with pytest.raises(ValueError, match="rollout_tp=2: the Ray controller's engines .* run one a worker"):
            check(config(tiny_rl_setup, tmp_path, rollout_tp=2), rc)


def test_a_reward_pool_without_a_reward_model_is_refused_by_name(tiny_rl_setup, tmp_path):
    """--ray.reward-workers with neither --reward-model-path nor --task arith-rlhf names the field (before any worker
    starts) rather than run without the pool it asked for."""
    with pytest.raises(ValueError, match=r"ray.reward_workers=1: a reward model's pool, but no reward model"):
        check(config(tiny_rl_setup, tmp_path), RayConfig(workers=1, reward_workers=1))
    with pytest.raises(ValueError, match=r"must divide by ray.reward_workers=3"):
        check(config(tiny_rl_setup, tmp_path, task="arith-rlhf"), RayConfig(workers=1, reward_workers=3))


def test_ray_ppo_split_equals_torchrun(tiny_rl_setup, ppo_two_ranks, tmp_path):
    """PPO with the critic in a pool and process group of its own (4 workers of half a CPU), the actor a LoRA
    adapter (its merged weights synced, verified, and exported), an adaptive KL coefficient in the reward: the run
    of conftest.ppo_two_ranks (torchrun, 2 ranks)."""
    cfg = config(tiny_rl_setup, tmp_path, **PPO_TWO_RANKS, hybrid=replace(Config().hybrid, verify_sync=True))
    train(RayTrainerConfig(cfg, RayConfig(workers=2, placement="split", cpus_per_worker=0.5)))
    assert_same_run(records(ppo_two_ranks), records(tmp_path), ppo_two_ranks, tmp_path, critic=True)
    assert "timing_s/values" in records(tmp_path)[1] and "critic/vf_loss" in records(tmp_path)[2]


# ---- a rollout pool of its own (async.rollout_workers) ----


def test_rollout_pool_synchronous_equals_colocated_and_a_hung_worker_is_replaced(grpo_runs, tmp_path):
    """Two generation-only engines beside two trainer workers, staleness 0, every sync verified. Trainer rank 1 stops
    answering in step 3's update (its call 3): the driver's call times out, it restarts the groups and the pool from
    step 2's checkpoint, and the run ends with the colocated uninterrupted run's numbers and final weights; ray/restarts
    counts the restart. (A worker that exits hard in its update: the one-step-off test below.)"""
    cfg, _, colocated = grpo_runs
    pooled = replace(cfg, out_dir=str(tmp_path), async_=AsyncConfig(rollout_workers=2, staleness=0))
    rc = RayConfig(workers=2, cpus_per_worker=0.5, fail_role="actor", fail_rank=1, fail_method="update", fail_call=3,
                   fail_mode="hang", call_timeout_s=15)  # the longest call of this run takes a few seconds
    records_ = train(RayTrainerConfig(pooled, rc))
    assert [r["ray/restarts"] for r in records_[1:]] == [0, 0, 1]  # step 3 ran again, in the new groups
    assert_same_run(colocated, records_, cfg.out_dir, tmp_path)
    for r in records_[1:]:
        assert r["async/staleness/max"] == 0 and r["sync/bytes"] > 0 and r["sync/probe_logprob_diff_max"] < 1e-4
        assert 0 <= r["perf/bubble/rollout"] <= 1 and 0 <= r["perf/bubble/actor"] <= 1
        assert r["async/rollout_restarts"] == 0  # the pool was replaced with the groups, not restarted on its own


def one_step_off(cfg: Config, out_dir, engines: int = 2) -> Config:
    """Staleness 1, the pool's engines HF generate (these tests are about the pool's faults, and an HF engine starts
    in a fraction of a vLLM engine's time)."""
    return replace(cfg, out_dir=str(out_dir), async_=AsyncConfig(rollout_workers=engines, staleness=1),
                   rollout_backend="hf")


def test_one_step_off_replaces_a_dead_rollout_worker(grpo_runs, tmp_path):
    """Staleness 1: every trained sample is at most one update behind. A rollout engine exits while it generates step
    3's batch ahead, during step 2's update (its call 14: 4 chunks each for steps 1 and 2, the step-0 evaluation,
    then step 3); the sync after step 2 finds it dead: a new pool takes the current weights and generates step 3's
    batch again (from them: staleness 0), and the trainer goes on."""
    cfg, _, _ = grpo_runs
    rc = RayConfig(workers=2, cpus_per_worker=0.5, fail_role="rollout", fail_rank=1, fail_method="generate",
                   fail_call=14)
    out = train(RayTrainerConfig(one_step_off(cfg, tmp_path), rc))
    assert [r["step"] for r in out] == [0, 1, 2, 3]
    assert [r["async/staleness/max"] for r in out[1:]] == [0, 1, 0]
    assert [r["async/rollout_restarts"] for r in out[1:]] == [0, 0, 1] and out[-1]["ray/restarts"] == 0
    assert all(r["sync/probe_logprob_diff_max"] < 1e-4 for r in out[1:])


def test_a_hung_engine_is_replaced_within_the_sync_timeout(grpo_runs, tmp_path):
    """An engine that stops answering (alive, not dead) at the sync after step 1: the trainer's broadcast and its
    barrier wait async.sync_timeout_s (4 s), not ray.call_timeout_s (10 minutes); the sync group is aborted, the
    pool replaced with the current weights, and the trainer goes on (no restart of its groups)."""
    cfg, _, _ = grpo_runs
    cfg = replace(one_step_off(cfg, tmp_path, engines=1), total_steps=2)
    cfg = replace(cfg, async_=replace(cfg.async_, sync_timeout_s=4.0))
    rc = RayConfig(workers=1, fail_role="rollout", fail_rank=0, fail_method="receive_weights", fail_call=2,
                   fail_mode="hang", call_timeout_s=600)  # call 1: the weights before step 1
    start = time.time()
    out = train(RayTrainerConfig(cfg, rc))
    assert time.time() - start < 120  # far below call_timeout_s: the side group's timeout found the hung engine
    assert [r["async/rollout_restarts"] for r in out[1:]] == [0, 1] and out[-1]["ray/restarts"] == 0
    assert all(r["sync/probe_logprob_diff_max"] < 1e-4 for r in out[1:])


def test_one_step_off_resumes_after_a_trainer_failure(grpo_runs, tmp_path):
    """A trainer worker exits hard in step 3's update: the run resumes from step 2's checkpoint with new groups and a
    new pool (of one engine here); step 3 runs again from weights synced at the resume (staleness 0), nothing lost."""
    cfg, _, _ = grpo_runs
    rc = RayConfig(workers=2, cpus_per_worker=0.5, fail_role="actor", fail_rank=0, fail_method="update", fail_call=3)
    out = train(RayTrainerConfig(one_step_off(cfg, tmp_path, engines=1), rc))
    assert [r["step"] for r in out] == [0, 1, 2, 3]
    assert [r["async/staleness/max"] for r in out[1:]] == [0, 1, 0] and out[-1]["ray/restarts"] == 1


def test_ray_with_the_reward_model_in_its_own_pool_equals_one_process(tiny_rl_setup, tmp_path):
    """HybridFlow's fourth model apart: the actor in one pool, the learned reward model (a random scalar head on the
    policy's tokenizer) in a pool of its own; HF generate, so one process computes the same run: the same scores of
    the reward model, rewards, losses and weights step for step."""
    from data import load_tokenizer
    from ppo import train as train_one
    from test_reward_model import scalar_head_model
    scalar_head_model(load_tokenizer(tiny_rl_setup["model_path"]), tmp_path / "rm")
    cfg = config(tiny_rl_setup, tmp_path / "one", rollout_backend="hf", reward_model_path=str(tmp_path / "rm"),
                 ckpt_every=0)
    train_one(cfg)
    on_ray = replace(cfg, out_dir=str(tmp_path / "ray"))
    train(RayTrainerConfig(on_ray, RayConfig(workers=1, reward_workers=1)))
    one, two = records(cfg.out_dir), records(on_ray.out_dir)
    assert_same_run(one, two, cfg.out_dir, on_ray.out_dir)
    for a, b in zip(one[1:], two[1:]):
        assert b["reward_model/score/mean"] == pytest.approx(a["reward_model/score/mean"], abs=1e-5)
        assert b["critic/score/mean"] == pytest.approx(b["reward_model/score/mean"], abs=1e-6)  # replace
        assert "timing_s/reward_model" in b
