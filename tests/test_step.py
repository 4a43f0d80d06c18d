"""What a step sees (its prompts and sampling seeds) and what a run refuses: an out_dir holding another run, bad
config values and files, rewards that are not finite numbers; dynamic sampling; a full disk; checkpoint retention.

    python -m pytest tests/test_step.py -q
"""

import errno
import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoTokenizer

from comm import init_distributed
from conftest import toy_config
from config import BUILTIN_TASK, Config, with_task_values
from core_algos import on_last_token, overlong_penalty
from data import checked_score, load_tokenizer
from ppo import Run, TorchrunController, check_out_dir, informative_groups, load_task, prompt_indices, rl_step, train
from tracking import step_warnings
from rollout import sample_seed
from sharding import find_latest, prune_checkpoints
from workers import ActorWorker


def test_sample_seeds_are_distinct_for_distinct_steps_and_rows():
    seeds = {(seed, step, row): sample_seed(seed, step, row) for seed in range(3) for step in range(1, 60)
             for row in range(200)}
    assert len(set(seeds.values())) == len(seeds)  # 35,400 triples, no collision
    # the old affine mix gave seed 1, step s, row r the seed of seed 0, step s + 10, row r - 27
    assert sample_seed(1, 5, 40) != sample_seed(0, 15, 13)
    assert sample_seed(0, 7, 3) == sample_seed(0, 7, 3) and 0 <= sample_seed(5, 1, 1) < 2**48


def test_prompt_indices_cover_each_epoch_then_reshuffle():
    cfg = Config(train_batch_size=4, ppo_mini_batch_size=4, seed=3)
    steps = [prompt_indices(step, cfg, n_rows=10) for step in range(1, 6)]  # 2 steps an epoch; 2 rows left over
    assert all(len(s) == 4 and len(set(s)) == 4 for s in steps)
    assert not set(steps[0]) & set(steps[1])  # an epoch's steps never repeat a row
    assert not set(steps[2]) & set(steps[3])
    assert steps[2] + steps[3] != steps[0] + steps[1]  # epoch 2 is a fresh permutation
    assert prompt_indices(3, cfg, 10) == steps[2]  # a step alone decides its rows (a resumed run replays them)
    assert steps[4] != steps[0] and all(0 <= i < 10 for s in steps for i in s)


def test_a_previous_run_is_never_overwritten_unasked(tmp_path):
    """metrics.jsonl of an earlier run without a checkpoint to resume from: refused (naming the folder and how to
    go on), unless overwrite; a checkpoint to resume from makes it a continuation."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    cfg = Config(out_dir=str(tmp_path))
    with pytest.raises(FileExistsError, match=f"out_dir={tmp_path} holds a previous run .2 lines.*--overwrite"):
        check_out_dir(cfg)
    check_out_dir(replace(cfg, overwrite=True))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_1")
    check_out_dir(cfg)  # resume auto finds it
    with pytest.raises(FileExistsError):
        check_out_dir(replace(cfg, resume="off"))
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1e-4), "lr=-0.0001 must be > 0"),
    (dict(model_path="/no/such/model"), "model_path=/no/such/model: not an HF model folder"),
    (dict(train_files="/no/such.parquet"), "train_files: no such parquet file /no/such.parquet"),
    (dict(reward_fn_path="/no/reward.py"), "reward_fn_path=/no/reward.py: no such file"),
])
def test_config_names_bad_values_before_anything_starts(kwargs, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        Config(**kwargs)


def test_a_model_you_bring_gets_verls_defaults_and_the_builtin_task_its_own(tiny_rl_setup, capsys):
    """With --model-path the defaults are verl's for a real model; without it the built-in task applies its own values
    to the fields left at their defaults (and says so once), while a field the user set keeps the user's value."""
    real = with_task_values(Config(model_path=tiny_rl_setup["model_path"], max_prompt_length=32,
                                   max_response_length=8))  # the tiny policy has 512 positions
    assert (real.lr, real.critic_lr, real.train_batch_size, real.ppo_mini_batch_size) == (1e-6, 1e-5, 1024, 256)
    assert real.log_prob_max_token_len_per_gpu == 16384 and Config().max_response_length == 1024
    assert capsys.readouterr().out == ""
    toy = with_task_values(Config(lr=1e-3))
    assert toy.lr == 1e-3 and {k: getattr(toy, k) for k in BUILTIN_TASK if k != "lr"} == {
        k: v for k, v in BUILTIN_TASK.items() if k != "lr"}
    assert "built-in task arith (no --model-path): critic_lr=0.001" in capsys.readouterr().out
    calc = with_task_values(Config(task="calculator", out_dir="out/grpo"))  # its answers need room, it has a tool
    assert (calc.max_response_length, calc.lr, calc.out_dir) == (32, BUILTIN_TASK["lr"], "out/grpo_calculator")
    assert calc.agent.tools_path.endswith("data/calculator.py") and calc.agent.call_end == "="


def test_a_run_with_a_model_checkpoints_every_tenth_by_default(tiny_rl_setup):
    """A crash of a real run loses at most a tenth of it (ckpt_every -1: every total_steps // 10 steps); the built-in
    task keeps its own (none), and a cadence you give stays."""
    real = dict(model_path=tiny_rl_setup["model_path"], max_prompt_length=32, max_response_length=8)
    assert with_task_values(Config(**real, total_steps=200)).checkpoint_every == 20
    assert with_task_values(Config(**real, total_steps=5)).checkpoint_every == 1
    assert with_task_values(Config(**real, total_steps=200, ckpt_every=7)).checkpoint_every == 7
    assert with_task_values(Config(total_steps=200)).checkpoint_every == 0


def test_lengths_beyond_the_models_positions_are_named(tiny_rl_setup):
    with pytest.raises(ValueError, match="max_prompt_length \\+ max_response_length = 1536 exceeds model_path's "
                                         "max_position_embeddings=512"):
        Config(model_path=tiny_rl_setup["model_path"])


@pytest.mark.parametrize("body, error, message", [
    ("return float('nan')", ValueError, "returned nan: a reward must be a finite number"),
    ("return 'correct'", TypeError, "returned 'correct' of type str, not a number"),
    ("return {'acc': 1.0}", TypeError, "returned a dict without a 'score' key"),
    ("raise ValueError('boom')", RuntimeError, "raised ValueError: boom"),  # not a bare traceback
])
def test_a_bad_reward_stops_the_run_naming_function_source_and_row(tiny_rl_setup, tmp_path, body, error, message):
    """The first scores (the step-0 evaluation) already stop the run, before any update or checkpoint."""
    (tmp_path / "bad.py").write_text(f"def judge(data_source, solution_str, ground_truth, extra_info=None):\n"
                                     f"    {body}\n")
    cfg = toy_config(**{**tiny_rl_setup, "reward_fn_path": str(tmp_path / "bad.py")}, reward_fn_name="judge",
                     rollout_backend="hf", train_batch_size=8, ppo_mini_batch_size=8, rollout_n=2,
                     max_response_length=4, total_steps=1, out_dir=str(tmp_path / "out"))
    with pytest.raises(error, match=rf"reward function judge \(.*bad.py:1\) on data_source 'arith' "
                                    rf"\(.*val.parquet, row 0\) {message}"):
        train(cfg)
    assert not (tmp_path / "out" / "final").exists()


def test_a_dict_with_a_score_is_read_as_verl_does():
    row = {"data_source": "arith", "where": "f.parquet, row 3"}
    assert checked_score({"score": 1, "acc": True}, len, row) == 1.0 and checked_score(True, len, row) == 1.0


MIXED_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 3 == 0:
        return 1.0  # every sample right: a group with nothing to learn
    if extra_info["index"] % 3 == 1:
        return 0.0  # every sample wrong: the same
    return float(len(solution_str) % 2)  # differs within a group (most of the time)
'''


def test_dynamic_sampling_fills_the_batch_with_informative_groups(tiny_rl_setup, tmp_path):
    """A third of the prompts always score 1 and a third always 0: dynamic sampling drops their groups, samples
    more prompts in rounds, and the step trains on train_batch_size groups whose rewards all differ within."""
    (tmp_path / "mixed.py").write_text(MIXED_REWARD)
    cfg = toy_config(**{**tiny_rl_setup, "reward_fn_path": str(tmp_path / "mixed.py")}, adv_estimator="grpo",
                     rollout_backend="hf", train_batch_size=8, ppo_mini_batch_size=8, rollout_n=4,
                     max_response_length=6, dynamic_sampling=True, max_gen_rounds=12, out_dir=str(tmp_path / "out"))
    dist = init_distributed()
    actor = ActorWorker(cfg, cfg.model_path, dist)
    task = load_task(cfg, cfg.model_path, cfg.train_files, cfg.val_files, 1)
    run = Run(cfg, task, actor, None, TorchrunController(dist))
    rows = [run.task.train_ds[i] for i in prompt_indices(1, cfg, len(run.task.train_ds))]
    metrics, batch, _ = rl_step(1, rows, run, 0.0)
    scores = batch["scores"].view(-1, cfg.rollout_n)  # [groups, n]
    assert scores.shape[0] == cfg.train_batch_size
    assert (scores.max(-1).values > scores.min(-1).values).all(), "a group with equal rewards was kept"
    assert all(i % 3 == 2 for i in batch["index"].tolist())
    assert metrics["dynamic/kept_groups"] == 8 and metrics["dynamic/filled_groups"] == 0
    assert metrics["dynamic/rounds"] >= 2 and metrics["dynamic/dropped_groups"] >= 8 - 8 // 3
    # the step replays: the same rounds, prompts and samples
    rerun = Run(cfg, task, ActorWorker(cfg, cfg.model_path, dist), None, TorchrunController(dist))
    again = rl_step(1, rows, rerun, 0.0)[1]
    assert again["index"].tolist() == batch["index"].tolist() and (again["responses"] == batch["responses"]).all()
    assert (batch["filler"] == 0).all() and torch.equal(batch["loss_mask"], batch["response_mask"])
    # one round only: dropped groups fill the batch, named as filler, and the policy loss leaves them out
    short = replace(cfg, max_gen_rounds=1)
    metrics, batch, _ = rl_step(1, rows, Run(short, task, ActorWorker(short, cfg.model_path, dist), None,
                                             TorchrunController(dist)), 0.0)
    filler = batch["filler"].bool()  # [B]
    assert metrics["dynamic/filled_groups"] == filler.sum().item() / cfg.rollout_n > 0 and metrics["dynamic/rounds"] == 1
    assert (batch["loss_mask"][filler] == 0).all() and torch.equal(batch["loss_mask"][~filler],
                                                                     batch["response_mask"][~filler])
    spread = batch["scores"][filler].view(-1, cfg.rollout_n)  # the fillers: groups of equal rewards
    assert (spread.max(-1).values == spread.min(-1).values).all()


def test_dapos_filter_reads_the_verifiers_scores_not_the_overlong_shaping():
    """An all-wrong group whose lengths differ gets differing scores from the overlong penalty: it is still no
    signal, and dynamic sampling drops it (the filter reads the verifier's scores, "acc"); a mixed group stays."""
    n, lengths = 4, torch.tensor([3, 6, 5, 2, 3, 6, 5, 2])  # 2 groups of 4; max 6 tokens, a buffer of 2
    acc = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    scores = acc + overlong_penalty(lengths, 6, 2, 1.0)  # [B]: the first group's scores now differ (0, -1, -0.5, 0)
    batch = TensorDict(acc=acc, scores=scores, batch_size=[8])
    assert scores[:4].unique().numel() > 1
    assert informative_groups(batch, n).tolist() == [False, True]
    assert informative_groups(TensorDict(scores=scores, batch_size=[8]), n).tolist() == [True, True]  # without acc


def test_kl_in_reward_with_the_engines_old_log_probs(tiny_rl_setup, tmp_path):
    """--use-kl-in-reward with --old-log-probs rollout: no recomputed pass, so the in-reward KL compares the engine's
    log-probs with the reference's (it raised KeyError 'old_log_probs'). At step 1 policy = reference, so the
    penalty is the engine-trainer gap only: tiny, and exactly k1 of rollout vs ref log-probs."""
    cfg = toy_config(**tiny_rl_setup, adv_estimator="reinforce_plus_plus", rollout_backend="hf", train_batch_size=4,
                     ppo_mini_batch_size=4, rollout_n=2, max_response_length=6, use_kl_in_reward=True,
                     old_log_probs="rollout", kl_coef=0.5, out_dir=str(tmp_path / "out"))
    dist = init_distributed()
    task = load_task(cfg, cfg.model_path, cfg.train_files, cfg.val_files, 1)
    run = Run(cfg, task, ActorWorker(cfg, cfg.model_path, dist), None, TorchrunController(dist))
    metrics, batch, _ = rl_step(1, [run.task.train_ds[i] for i in prompt_indices(1, cfg, len(run.task.train_ds))], run, 0.5)
    assert "old_log_probs" not in batch.keys()
    mask = batch["response_mask"]
    kl = (batch["rollout_log_probs"] - batch["ref_log_probs"]) * mask  # [B, R], k1
    expected = on_last_token(batch["scores"], mask) - 0.5 * kl
    torch.testing.assert_close(batch["token_level_rewards"], expected)
    assert abs(metrics["actor/reward_kl_penalty"]) < 1e-4


def test_a_tokenizer_without_pad_gets_eos(tiny_rl_setup, tmp_path):
    """Llama-3-style tokenizers have no pad token: the RL workers pad with EOS (the masks come from lengths)."""
    tokenizer = load_tokenizer(tiny_rl_setup["model_path"])
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_rl_setup["model_path"], name), tmp_path / name)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token_id is None
    cfg = toy_config(model_path=str(tmp_path), rollout_backend="hf", rollout_n=2, max_response_length=6)
    actor = ActorWorker(cfg, cfg.model_path, init_distributed())
    batch, _ = actor.generate([[5, 6, 7], [8, 9]], seeds=[0, 1])
    assert actor.tokenizer.pad_token_id == actor.tokenizer.eos_token_id
    assert (batch["prompts"][2:, 0] == actor.tokenizer.eos_token_id).all()  # the shorter prompt, left-padded


def test_a_full_disk_leaves_latest_on_the_previous_checkpoint(tiny_rl_setup, tmp_path, monkeypatch):
    """The second checkpoint's write fails with ENOSPC: the run stops naming the disk, its partial folder is gone,
    and `latest` still names step_1, from which the same command resumes."""
    cfg = toy_config(**tiny_rl_setup, rollout_backend="hf", train_batch_size=8, ppo_mini_batch_size=8, rollout_n=2,
                     max_response_length=4, total_steps=3, ckpt_every=1, out_dir=str(tmp_path / "out"))
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # any file of the second checkpoint
        if "step_2.tmp" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(RuntimeError, match=r"step_2.tmp failed \(\[Errno 28\] No space left on device\); \d+ MB free "
                                           r"on the disk of .*step_1"):
        train(cfg)
    ckpt = tmp_path / "out" / "checkpoints"
    assert find_latest(str(ckpt)) == str(ckpt / "step_1") and sorted(os.listdir(ckpt)) == ["latest", "step_1"]
    monkeypatch.setattr(torch, "save", real_save)
    records = train(cfg)  # the same command resumes
    assert [r["step"] for r in records] == [0, 1, 2, 3]


def test_retention_keeps_the_newest_the_best_and_the_latest(tmp_path):
    for step in range(1, 7):
        (tmp_path / f"step_{step}").mkdir()
    (tmp_path / "step_7.tmp").mkdir()  # a save in progress is never touched
    (tmp_path / "latest").write_text("step_6")
    assert prune_checkpoints(str(tmp_path), keep=2, protect={2}) == [4, 3, 1]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_2", "step_5", "step_6", "step_7.tmp"]


def test_step_warnings_name_the_step_and_fire_once_per_occurrence():
    ok = {"step": 4, "actor/skipped_steps": 0.0, "actor/pg_loss": 0.1, "response_length/clip_ratio": 0.2}
    assert step_warnings(ok, {}) == []
    bad = {**ok, "step": 5, "actor/skipped_steps": 1.0, "actor/pg_loss": float("nan"),
           "response_length/clip_ratio": 0.75}
    lines = step_warnings(bad, ok)
    assert lines[0] == "step 5: actor skipped 1 optimizer step(s): a non-finite gradient"
    assert lines[1] == "step 5: non-finite metrics: actor/pg_loss"
    assert lines[2].startswith("step 5: 75% of the responses hit max_response_length")
    still = {**ok, "step": 6, "response_length/clip_ratio": 0.8}
    assert step_warnings(still, bad) == []  # the same occurrence of many truncated responses: said once


def test_a_malformed_parquet_fails_before_any_model_loads(tiny_rl_setup, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import ppo

    rows = pq.read_table(tiny_rl_setup["train_files"]).to_pylist()
    rows[5]["prompt"] = []  # no message
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    started = []
    monkeypatch.setattr(ppo, "ActorWorker", lambda *a, **k: started.append("actor"))
    cfg = toy_config(**{**tiny_rl_setup, "train_files": str(tmp_path / "bad.parquet")}, rollout_backend="hf",
                     out_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"bad.parquet, row 5: field 'prompt' must be a non-empty list"):
        train(cfg)
    assert started == []


def test_an_unreadable_checkpoint_is_named_and_the_previous_one_resumes(tiny_rl_setup, tmp_path, capsys):
    """A truncated .distcp in the latest checkpoint: --resume latest stops naming it and the readable one; auto says
    so and resumes from the previous checkpoint, ending with the uninterrupted run's weights. (The uninterrupted run
    also shows summary.json.)"""
    from safetensors.torch import load_file

    def cfg(out, steps, **kw):
        return toy_config(**tiny_rl_setup, rollout_backend="hf", train_batch_size=4, ppo_mini_batch_size=4,
                          rollout_n=2, max_response_length=4, total_steps=steps, ckpt_every=2, eval_every=10,
                          out_dir=str(tmp_path / out), **kw)

    train(cfg("whole", 6))
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())  # the run summary, at the end
    assert summary["steps"] == 6 and summary["skipped_steps"] == 0 and summary["tokens_per_s_per_rank"] > 0
    assert 0 < summary["phase_share"]["gen"] < 1 and 0 < summary["phase_share"]["update_actor"] < 1
    assert os.path.isdir(summary["best_checkpoint"]) and summary["peak_memory_gb"]["update_actor"] > 0
    assert 0 < summary["mfu"]["actor"] < 1 and 0 <= summary["overhead_share"] < 1
    assert summary["best_val_accuracy"] == max(r["val/accuracy"] for r in map(json.loads, open(
        tmp_path / "whole" / "metrics.jsonl")) if "val/accuracy" in r)
    train(cfg("broken", 4))
    shard = next((tmp_path / "broken" / "checkpoints" / "step_4" / "actor").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(RuntimeError, match=rf"{shard.name} has 100 bytes, .* the newest readable one is .*step_2"):
        train(cfg("broken", 6, resume="latest"))
    capsys.readouterr()
    train(cfg("broken", 6))
    err = capsys.readouterr().err
    assert f"{shard.name} has 100 bytes" in err and "Falling back to" in err and "step_2" in err
    whole, resumed = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("whole", "broken"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus", "gae"])
def test_one_step_by_hand(tiny_rl_setup, tmp_path, estimator):
    """One rl_step of RLOO, REINFORCE++ and PPO (GAE) against direct formulas written here, beside "reward rises":
    the advantages from the step's scores (and values), and the update's gradients, which on-policy (ratio 1, no
    clipping) are those of -sum(A * log p) / tokens for the actor and 0.5 * sum((V - G)^2) / tokens for the critic,
    taken by autograd through a plain HF forward of the starting weights."""
    import copy

    import torch.nn.functional as F
    from dist_batching import capture_gradients
    from workers import CriticWorker

    gamma, lam = 0.9, 0.8
    cfg = toy_config(**tiny_rl_setup, adv_estimator=estimator, rollout_backend="hf", train_batch_size=4,
                     ppo_mini_batch_size=4, rollout_n=4, max_response_length=6, grad_clip=1e9, gamma=gamma, lam=lam,
                     out_dir=str(tmp_path / "out"))
    dist = init_distributed()
    actor = ActorWorker(cfg, cfg.model_path, dist)
    critic = CriticWorker(cfg, cfg.model_path, dist) if estimator == "gae" else None
    start = {"actor": copy.deepcopy(actor.model), "critic": copy.deepcopy(critic.model) if critic else None}
    grads = {"actor": capture_gradients(actor), "critic": capture_gradients(critic) if critic else None}
    task = load_task(cfg, cfg.model_path, cfg.train_files, cfg.val_files, 1)
    rows = [task.train_ds[i] for i in prompt_indices(1, cfg, len(task.train_ds))]
    _, batch, _ = rl_step(1, rows, Run(cfg, task, actor, critic, TorchrunController(dist)), cfg.kl_coef)

    mask, scores, n = batch["response_mask"], batch["scores"].double(), cfg.rollout_n
    lengths = mask.sum(-1).long().tolist()
    assert scores.view(-1, n).std(-1).max() > 0  # the digit reward differs within groups: advantages to check
    expected = torch.zeros(mask.shape, dtype=torch.float64)  # [B, R]
    returns = torch.zeros_like(expected)
    for b, length in enumerate(lengths):
        if estimator == "rloo":  # the response's score minus the mean of its group's other n - 1
            g = b // n
            others = (scores[g * n : g * n + n].sum() - scores[b]) / (n - 1)
            expected[b, :length] = scores[b] - others
        elif estimator == "reinforce_plus_plus":  # the discounted return of the score on the last token
            for t in range(length):
                expected[b, t] = gamma ** (length - 1 - t) * scores[b]
        else:  # GAE on the critic's values, the score as the last token's reward, V = 0 after the end
            values = batch["values"][b].double()
            running = 0.0
            for t in reversed(range(length)):
                next_value = values[t + 1] if t + 1 < length else 0.0
                delta = (scores[b] if t == length - 1 else 0.0) + gamma * next_value - values[t]
                running = delta + gamma * lam * running
                expected[b, t] = running
            returns[b, :length] = expected[b, :length] + values[:length]
    if estimator != "rloo":  # whitened over the batch's tokens (unbiased variance)
        real = mask.bool()
        expected = (expected - expected[real].mean()) / (expected[real].var() + 1e-8).sqrt() * mask
    torch.testing.assert_close(batch["advantages"].double(), expected, atol=1e-5, rtol=1e-5)

    R, tokens = mask.shape[1], mask.sum()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    logits = start["actor"](**inputs).logits[:, -R - 1 : -1]  # [B, R, V]: the positions that predict the response
    logp = F.log_softmax(logits / cfg.temperature, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    (-(batch["advantages"] * logp * mask).sum() / tokens).backward()
    for name, p in start["actor"].named_parameters():
        torch.testing.assert_close(grads["actor"][0][name], p.grad, atol=1e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    if critic:
        torch.testing.assert_close(batch["returns"].double(), returns, atol=1e-5, rtol=1e-5)
        values = start["critic"](**inputs).logits.squeeze(-1)[:, -R - 1 : -1]  # [B, R]: the state before each token
        (0.5 * ((values - batch["returns"]).square() * mask).sum() / tokens).backward()
        for name, p in start["critic"].named_parameters():
            torch.testing.assert_close(grads["critic"][0][name], p.grad, atol=1e-6, rtol=1e-4,
                                       msg=lambda m: f"critic {name}: {m}")
