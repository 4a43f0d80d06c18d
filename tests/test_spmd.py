"""grpo.py and ppo.py as a user runs them: torchrun with 2 ranks (gloo, one vLLM engine per rank), and resumption.

    python -m pytest tests/test_spmd.py -q

- 2 ranks log the same metrics as 1 process, and sample the same first step (seeds follow the prompt, not the rank),
  training a LoRA adapter.
- A run killed after a checkpoint and resumed with resume=auto replays the uninterrupted run: same per-step
  rewards, same final parameters.
- A checkpoint written by 2 ranks (LoRA: the adapter and its optimizer state) resumes in 1 process.
- When a rank dies (os._exit) or hangs, the other exits with an error that names it, within dist_timeout_s, and the
  same command resumes from the latest checkpoint (tests/dist_rank_fault.py injects the fault).
- Dynamic sampling fills 1 process and 2 ranks alike with informative groups. A run's console stays quiet.
- PPO with a critic on 2 ranks: values, returns and advantages (whitened over both ranks) of the first step equal
  one process's; its checkpoint resumes in 1 process with the trained critic, and the adaptive KL coefficient
  continues its recursion.
"""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from config import BUILTIN_TASK
from core_algos import update_kl_coef

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}  # two ranks share 2 cores


def args(setup: dict, out_dir, **overrides) -> list[str]:
    cfg = {**BUILTIN_TASK, **setup, "train_batch_size": 8, "ppo_mini_batch_size": 4, "rollout_n": 4,
           "max_response_length": 6, "lr": 3e-3, "eval_every": 2, "out_dir": str(out_dir), **overrides}
    return [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()] + ["--hybrid.verify-sync"]  # every sync proven


def launch(argv: list[str], log_path, ranks: int = 1, wait: bool = True, script: str = "grpo.py", env: dict = {}):
    """Run script (under torchrun when ranks > 1), its output in log_path (a file: a pipe could fill and block)."""
    if ranks == 1:
        cmd = [sys.executable, os.path.join(ROOT, script)]
    else:
        with socket.socket() as s:  # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               f"--master_port={port}", os.path.join(ROOT, script)]
    with open(log_path, "a") as log:
        start = log.tell()
        proc = subprocess.Popen(cmd + argv, env={**ENV, **env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    if wait:
        proc.wait(timeout=300)
        with open(log_path) as log:
            output = log.read()[start:]
        assert proc.returncode == 0, output[-3000:]
        assert "Traceback" not in output, output[-3000:]  # e.g. vLLM's shutdown after the process group is gone
    return proc


def records(out_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def final_weights(out_dir) -> dict:
    return load_file(os.path.join(out_dir, "final", "model.safetensors"))


LORA = ["--lora-rank=4", "--lora-alpha=8", "--use-kl-loss"]  # the two_ranks runs train an adapter (lora.py)


@pytest.fixture(scope="module")
def two_ranks(tiny_rl_setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    launch(args(tiny_rl_setup, out, total_steps=2, ckpt_every=2, lr=1e-2) + LORA, out / "log", ranks=2)
    return out


def test_two_ranks_log_what_one_process_logs(tiny_rl_setup, two_ranks, tmp_path):
    """LoRA on FSDP2 (the merged weights' syncs verified, the KL to the adapters-off base) as in one process."""
    launch(args(tiny_rl_setup, tmp_path, total_steps=2, lr=1e-2) + LORA, tmp_path / "log")
    one, two = records(tmp_path), records(two_ranks)
    assert [r.keys() for r in one] == [r.keys() for r in two] and two[2]["actor/kl_loss"] > 0
    assert one[0]["val/accuracy"] == two[0]["val/accuracy"]  # the same initial weights, greedy
    # step 1 samples with the initial weights and per-prompt seeds: the same responses on 1 or 2 ranks
    for key in ("critic/score/mean", "response_length/mean"):
        assert one[1][key] == pytest.approx(two[1][key], abs=1e-6), key
    assert all(os.path.isfile(d / "final" / "adapter" / "adapter_model.safetensors") for d in (tmp_path, two_ranks))
    # what the step cost (perf.py), every step: MFU, per-phase memory, the all-reduce probe, the KV cache's use
    phases = ("gen", "reshard", "old_log_prob", "ref", "update_actor")
    for r in two[1:]:
        for key in ("perf/mfu/actor", "perf/allreduce_ms", "rollout/kv_cache_usage_max", "rollout/preemptions",
                    "perf/overhead_share", *(f"perf/max_memory_gb/{p}" for p in phases)):
            assert math.isfinite(r[key]), (key, r)
        assert 0 < r["perf/mfu/actor"] < 1 and r["perf/allreduce_ms"] > 0 and 0 < r["rollout/kv_cache_usage_max"] <= 1
        assert 0 <= r["perf/overhead_share"] < 1 and r["perf/max_memory_gb/update_actor"] > 0.1  # GB: a process's RSS
    assert one[1]["perf/allreduce_ms"] == 0.0  # one process: no collective to time


def test_two_rank_checkpoint_resumes_in_one_process(tiny_rl_setup, two_ranks, tmp_path):
    """The 2-rank run's step-2 checkpoint (LoRA adapter, AdamW state) loads in one process: resumed there (in a copy,
    the fixture stays as it was) with nothing left to train, it exports exactly the weights the 2 ranks exported."""
    copy = tmp_path / "copy"
    shutil.copytree(two_ranks, copy)
    shutil.rmtree(copy / "final")
    launch(args(tiny_rl_setup, copy, total_steps=2, ckpt_every=2, lr=1e-2) + LORA, tmp_path / "log")
    assert "resumed from" in open(tmp_path / "log").read() and "step_2" in open(tmp_path / "log").read()
    resumed, trained = final_weights(copy), final_weights(two_ranks)
    for weights in (resumed, trained):  # the head is tied: the 2-rank export writes it out, one process does not
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    assert resumed.keys() == trained.keys(), set(resumed.keys()) ^ set(trained.keys())
    assert all(resumed[k].equal(trained[k]) for k in trained), [k for k in trained if not resumed[k].equal(trained[k])]


def assert_quiet(log_path):
    """vLLM's INFO lines stay off by default (--verbose brings them back): besides the progress bars, a run prints
    a few dozen lines at most, none of them per step."""
    parts = re.split(r"[\r\n]", open(log_path).read())
    bar = re.compile(r"(it/s|s/it)\]|^\s*rl:|Writing model shards|Loading weights")
    lines = [p for p in parts if p.strip() and not bar.search(p)]
    assert len(lines) < 40, "\n".join(lines)
    assert not [p for p in lines if " INFO " in p], "\n".join(lines)


def test_killed_run_resumes_exactly(tiny_rl_setup, tmp_path):
    """(Its uninterrupted 6-step run also shows that the console stays quiet: assert_quiet.)"""
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    launch(args(tiny_rl_setup, whole, total_steps=6, ckpt_every=2), tmp_path / "whole.log")
    assert_quiet(tmp_path / "whole.log")
    proc = launch(args(tiny_rl_setup, broken, total_steps=6, ckpt_every=2), tmp_path / "broken.log", wait=False)
    latest = broken / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, mid-run
    proc.wait()
    assert latest.exists() and not (broken / "final").exists(), "the run must die after a checkpoint, before its end"
    launch(args(tiny_rl_setup, broken, total_steps=6, ckpt_every=2), tmp_path / "resumed.log")  # resume=auto
    assert "resumed from" in open(tmp_path / "resumed.log").read()
    a, b = records(whole), records(broken)
    assert [r["step"] for r in b] == list(range(7))
    assert [r.get("critic/score/mean") for r in a] == [r.get("critic/score/mean") for r in b]
    wa, wb = final_weights(whole), final_weights(broken)
    for name in wa:
        assert (wa[name] - wb[name]).abs().max() <= 1e-6, name


def run_with_fault(argv: list[str], log_path, fault: str, timeout_s: int) -> str:
    """Launch 2 ranks with NANOVERL_FAULT, wait for the fault, then for the run to end within timeout_s; the log."""
    proc = launch(argv, log_path, ranks=2, wait=False, script="tests/dist_rank_fault.py", env={"NANOVERL_FAULT": fault})
    deadline = time.time() + 300
    while "[fault injection]" not in open(log_path).read() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert "[fault injection]" in open(log_path).read(), open(log_path).read()[-3000:]
    proc.wait(timeout=timeout_s)  # TimeoutExpired: a rank hung on past dist_timeout_s
    assert proc.returncode != 0
    return open(log_path).read()


def test_dead_rank_is_named_and_the_same_command_resumes(tiny_rl_setup, tmp_path):
    argv = args(tiny_rl_setup, tmp_path / "out", total_steps=3, ckpt_every=1, dist_timeout_s=60)
    log = run_with_fault(argv, tmp_path / "fault.log", "1:2:exit", timeout_s=60)
    assert "RankFailure: rank 0 stops: rank 1 died" in log, log[-3000:]
    assert "Run the same command again to resume" in log
    launch(argv, tmp_path / "resume.log", ranks=2, script="tests/dist_rank_fault.py")  # no fault this time
    resumed = open(tmp_path / "resume.log").read()
    assert "resumed from" in resumed and "step_1" in resumed, resumed[-3000:]
    assert [r["step"] for r in records(tmp_path / "out")] == [0, 1, 2, 3]


def test_stuck_rank_is_named_after_dist_timeout(tiny_rl_setup, tmp_path):
    timeout = 20
    argv = args(tiny_rl_setup, tmp_path / "out", total_steps=2, dist_timeout_s=timeout)
    log = run_with_fault(argv, tmp_path / "fault.log", "1:2:hang", timeout_s=timeout + 60)
    assert "RankFailure: rank 0 stops: rank 1 is alive but did not take part" in log, log[-3000:]
    assert "Timed out" in log  # gloo's error, after dist_timeout_s


MIXED_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 3 == 0:
        return 1.0
    if extra_info["index"] % 3 == 1:
        return 0.0
    return float(len(solution_str) % 2)
"""


def test_dynamic_sampling_fills_both_ranks_with_informative_groups(tiny_rl_setup, tmp_path):
    """Two thirds of the prompts give groups with equal rewards: on 1 process and on 2 ranks alike, the step ends
    with train_batch_size informative groups (none filled in), every rank running the same rounds."""
    (tmp_path / "mixed.py").write_text(MIXED_REWARD)
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}"
        argv = args({**tiny_rl_setup, "reward_fn_path": str(tmp_path / "mixed.py")}, out, total_steps=1,
                    max_gen_rounds=12) + ["--dynamic-sampling"]
        launch(argv, tmp_path / f"ranks{ranks}.log", ranks=ranks)
        step = records(out)[1]
        assert step["dynamic/kept_groups"] == 8 and step["dynamic/filled_groups"] == 0, step
        assert step["dynamic/rounds"] >= 2 and step["dynamic/dropped_groups"] >= 6


def test_ppo_two_ranks_match_one_process_and_resume_in_one(tiny_rl_setup, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    kl = ["--use-kl-in-reward", "--kl-ctrl-type=adaptive", "--kl-horizon=100"]  # a coefficient that moves
    launch(args(tiny_rl_setup, two, total_steps=2, ckpt_every=2, critic_warmup=1) + kl, tmp_path / "two.log", ranks=2,
           script="ppo.py")
    launch(args(tiny_rl_setup, one, total_steps=2, critic_warmup=1) + kl, tmp_path / "one.log", script="ppo.py")
    a, b = records(one), records(two)
    assert [r.keys() for r in a] == [r.keys() for r in b]
    # step 1: the same responses and initial critic; max/min reduce exactly across ranks, and the advantages'
    # extremes agree only if both ranks whiten with the statistics of the whole batch
    for key in ("critic/score/mean", "critic/values/max", "critic/values/min", "critic/returns/max",
                "critic/returns/min", "critic/advantages/max", "critic/advantages/min"):
        assert a[1][key] == pytest.approx(b[1][key], abs=1e-5), key
    # the 2-rank checkpoint (actor, critic and the KL coefficient) resumes in one process; a critic_lr far below
    # fp32 resolution leaves the resumed critic as it was restored, so its export must equal the 2-step run's
    trained_critic = load_file(os.path.join(two, "critic", "model.safetensors"))
    launch(args(tiny_rl_setup, two, total_steps=3, ckpt_every=2, critic_warmup=1) + kl + ["--critic-lr=1e-30"],
           tmp_path / "resume.log", script="ppo.py")
    assert "resumed from" in open(tmp_path / "resume.log").read()
    resumed_critic = load_file(os.path.join(two, "critic", "model.safetensors"))
    assert resumed_critic.keys() == trained_critic.keys()
    for name, weight in trained_critic.items():
        assert (resumed_critic[name] - weight).abs().max() <= 1e-6, name
    b = records(two)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    expected = update_kl_coef(b[2]["actor/reward_kl_penalty_coeff"], b[2]["actor/reward_kl_penalty"],
                              8 * 4, "adaptive", 0.1, 100)  # train_batch_size x rollout_n responses; kl_target 0.1
    assert b[3]["actor/reward_kl_penalty_coeff"] == pytest.approx(expected, rel=1e-12)
    assert b[3]["actor/reward_kl_penalty_coeff"] != 0.001  # kl_coef's default
