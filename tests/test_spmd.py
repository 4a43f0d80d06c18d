"""grpo.py and ppo.py as a user runs them: torchrun with 2 ranks (gloo, one vLLM engine per rank), and resumption.

    python -m pytest tests/test_spmd.py -q

- PPO with a critic and a LoRA actor on 2 ranks (one launch, conftest.ppo_two_ranks, that test_ray.py compares
  against too) logs the same metrics as 1 process and samples the same first step (seeds follow the prompt, not the
  rank); values, returns and advantages (whitened over both ranks) of that step equal one process's. A run's console
  stays quiet.
- Its checkpoint (the adapter, the critic, their optimizer states, the adaptive KL coefficient) resumes in 1
  process: the same actor and critic, and the KL coefficient continues its recursion.
- When a rank dies (os._exit) after a checkpoint, the other exits with an error that names it, and the same command
  resumes from that checkpoint and replays the uninterrupted run: same per-step metrics, same final parameters.
  That run has one vLLM engine a rank, the uninterrupted one a single engine sharded over both (rollout_tp 2): the
  same samples, losses and grad norms, every sync into the sharded engine verified.
  When a rank hangs, the other names it after dist_timeout_s. (tests/dist_rank_fault.py injects the faults.)
- Dynamic sampling fills 1 process and 2 ranks alike with informative groups (the 2 ranks: the first step of the
  run in which a rank then hangs).
"""

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from conftest import PPO_TWO_RANKS
from config import BUILTIN_TASK
from core_algos import update_kl_coef

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}  # two ranks share 2 cores


def args(setup: dict, out_dir, **overrides) -> list[str]:
    cfg = {**BUILTIN_TASK, **setup, "train_batch_size": 8, "ppo_mini_batch_size": 4, "rollout_n": 4,
           "max_response_length": 6, "lr": 3e-3, "eval_every": 2, "out_dir": str(out_dir), **overrides}
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]
    return flags + ["--hybrid.verify-sync"]  # every sync proven


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
        finished(proc, log_path, start)
    return proc


def finished(proc: subprocess.Popen, log_path, start: int = 0) -> None:
    """Wait for a launched run: it must succeed, with no traceback in its output (from offset start of log_path)."""
    proc.wait(timeout=300)
    with open(log_path) as log:
        output = log.read()[start:]
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]  # e.g. vLLM's shutdown after the process group is gone


def records(out_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def weights_equal(a: dict, b: dict, tol: float = 1e-6) -> None:
    """The same tensors within tol. A tied head: the 2-rank export writes lm_head out, one process does not."""
    for weights in (a, b):
        if "model.embed_tokens.weight" in weights:
            weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    assert a.keys() == b.keys(), set(a.keys()) ^ set(b.keys())
    for name in a:
        assert (a[name] - b[name]).abs().max() <= tol, name


def assert_quiet(log_path):
    """vLLM's INFO lines stay off by default (--verbose brings them back): besides the progress bars, a run prints
    a few dozen lines at most, none of them per step."""
    parts = re.split(r"[\r\n]", open(log_path).read())
    bar = re.compile(r"(it/s|s/it)\]|^\s*rl:|Writing model shards|Loading weights")
    lines = [p for p in parts if p.strip() and not bar.search(p)]
    assert len(lines) < 40, "\n".join(lines)
    assert not [p for p in lines if " INFO " in p], "\n".join(lines)


@pytest.fixture(scope="module")
def one_process(tiny_rl_setup, ppo_two_ranks, tmp_path_factory):
    """The two 1-process runs of the tests below, at once (one core each): PPO_TWO_RANKS's run (folder "run"), and
    the 2 ranks' run resumed for one more step in a copy (folder "copy", learning rates far below fp32 resolution).
    The root folder; each run's log beside its folder."""
    root = tmp_path_factory.mktemp("one_process")
    copy = root / "copy"
    shutil.copytree(ppo_two_ranks, copy)
    shutil.rmtree(copy / "final")
    shutil.rmtree(copy / "critic")
    resume = {**PPO_TWO_RANKS, "total_steps": 3, "lr": 1e-30, "critic_lr": 1e-30}
    procs = [launch(args(tiny_rl_setup, root / name, **kw), root / f"{name}.log", wait=False, script="ppo.py")
             for name, kw in (("run", PPO_TWO_RANKS), ("copy", resume))]
    for proc, name in zip(procs, ("run", "copy")):
        finished(proc, root / f"{name}.log")
    return root


def test_two_ranks_log_what_one_process_logs(ppo_two_ranks, one_process):
    """PPO with a critic and a LoRA actor on FSDP2 (the merged weights' syncs verified, the reward's KL to the
    adapters-off base) on 2 ranks (conftest.ppo_two_ranks) as in one process; the one process's console stays quiet."""
    assert_quiet(one_process / "run.log")
    one, two = records(one_process / "run"), records(ppo_two_ranks)
    assert [r.keys() for r in one] == [r.keys() for r in two] and two[2]["actor/reward_kl_penalty"] > 0
    assert one[0]["val/accuracy"] == two[0]["val/accuracy"]  # the same initial weights, greedy
    # step 1 samples with the initial weights and per-prompt seeds: the same responses on 1 or 2 ranks
    for key in ("critic/score/mean", "response_length/mean"):
        assert one[1][key] == pytest.approx(two[1][key], abs=1e-6), key
    # and the same initial critic; max/min reduce exactly across ranks, and the advantages' extremes agree only if
    # both ranks whiten with the statistics of the whole batch
    for key in ("critic/values/max", "critic/values/min", "critic/returns/max", "critic/returns/min",
                "critic/advantages/max", "critic/advantages/min"):
        assert one[1][key] == pytest.approx(two[1][key], abs=1e-5), key
    for d in (one_process / "run", ppo_two_ranks):
        assert os.path.isfile(d / "final" / "adapter" / "adapter_model.safetensors")
    # what the step cost (perf.py), every step: MFU, per-phase memory, the all-reduce probe, the KV cache's use
    phases = ("gen", "reshard", "old_log_prob", "ref", "update_actor")
    for r in two[1:]:
        for key in ("perf/mfu/actor", "perf/allreduce_ms", "rollout/kv_cache_usage_max", "rollout/preemptions",
                    "perf/overhead_share", *(f"perf/max_memory_gb/{p}" for p in phases)):
            assert math.isfinite(r[key]), (key, r)
        assert 0 < r["perf/mfu/actor"] < 1 and r["perf/allreduce_ms"] > 0 and 0 < r["rollout/kv_cache_usage_max"] <= 1
        assert 0 <= r["perf/overhead_share"] < 1 and r["perf/max_memory_gb/update_actor"] > 0.1  # GB: a process's RSS
    assert one[1]["perf/allreduce_ms"] == 0.0  # one process: no collective to time


def test_two_rank_checkpoint_resumes_in_one_process(ppo_two_ranks, one_process):
    """The 2 ranks' step-2 checkpoint (LoRA adapter, critic, their AdamW states, the KL coefficient) loads in one
    process: resumed there (in a copy, the fixture stays as it was) for a step with learning rates far below fp32
    resolution, it exports exactly the actor and critic the 2 ranks exported, and the adaptive KL coefficient
    continues its recursion."""
    copy = one_process / "copy"
    log = open(one_process / "copy.log").read()
    assert "resumed from" in log and "step_2" in log, log[-3000:]
    for folder in ("final", "critic"):
        weights_equal(*(load_file(os.path.join(d, folder, "model.safetensors")) for d in (copy, ppo_two_ranks)))
    b = records(copy)
    assert [r["step"] for r in b] == [0, 1, 2, 3] and b[:3] == records(ppo_two_ranks)
    expected = update_kl_coef(b[2]["actor/reward_kl_penalty_coeff"], b[2]["actor/reward_kl_penalty"],
                              8 * 4, "adaptive", 0.1, 100)  # train_batch_size x rollout_n responses; kl_target 0.1
    assert b[3]["actor/reward_kl_penalty_coeff"] == pytest.approx(expected, rel=1e-12)
    assert b[3]["actor/reward_kl_penalty_coeff"] != 0.001  # kl_coef's default


def run_with_fault(argv: list[str], log_path, fault: str, timeout_s: int, meanwhile=None) -> str:
    """Launch 2 ranks with NANOVERL_FAULT, wait for the fault (then call meanwhile(), if given, which must not
    block), then for the run to end within timeout_s; the log."""
    proc = launch(argv, log_path, ranks=2, wait=False, script="tests/dist_rank_fault.py", env={"NANOVERL_FAULT": fault})
    deadline = time.time() + 300
    while "[fault injection]" not in open(log_path).read() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert "[fault injection]" in open(log_path).read(), open(log_path).read()[-3000:]
    if meanwhile:
        meanwhile()
    proc.wait(timeout=timeout_s)  # TimeoutExpired: a rank hung on past dist_timeout_s
    assert proc.returncode != 0
    return open(log_path).read()


# what a resumed run must replay exactly (timings and memory vary from run to run)
REPLAYED = ("actor/", "critic/", "val/", "response_length/")


@pytest.fixture(scope="module")
def dead_rank(tiny_rl_setup, tmp_path_factory):
    """PPO_TWO_RANKS's run with one engine a rank, in which rank 1 exits hard (os._exit) at the start of step 2,
    after step 1's checkpoint, and the same command then resumes it: (its folder, the fault's log, the resume's)."""
    root = tmp_path_factory.mktemp("dead_rank")
    argv = args(tiny_rl_setup, root / "out", **PPO_TWO_RANKS, dist_timeout_s=60)
    log = run_with_fault(argv, root / "fault.log", "1:2:exit", timeout_s=60)
    died_before_final = not (root / "out" / "final").exists()
    launch(argv, root / "resume.log", ranks=2, script="tests/dist_rank_fault.py")  # no fault this time
    return root / "out", log, open(root / "resume.log").read(), died_before_final


def test_dead_rank_is_named_and_the_same_command_resumes_exactly(ppo_two_ranks, dead_rank):
    """Rank 0 names the dead rank and stops; the same command resumes from step 1 and replays the uninterrupted run
    (conftest's ppo_two_ranks): the same per-step metrics, the same final actor and critic."""
    out, log, resumed, died_before_final = dead_rank
    assert "RankFailure: rank 0 stops: rank 1 died" in log, log[-3000:]
    assert "Run the same command again to resume" in log and died_before_final
    assert "resumed from" in resumed and "step_1" in resumed, resumed[-3000:]
    a, b = records(ppo_two_ranks), records(out)
    assert [r["step"] for r in b] == [r["step"] for r in a] == [0, 1, 2]
    for ra, rb in zip(a, b):
        keys = [k for k in ra if k.startswith(REPLAYED)]
        assert keys == [k for k in rb if k.startswith(REPLAYED)] and (ra["step"] == 0 or "critic/vf_loss" in keys)
        for key in keys:
            assert ra[key] == pytest.approx(rb[key], abs=1e-6), (ra["step"], key)
    for folder in ("final", "critic"):
        weights_equal(*(load_file(os.path.join(d, folder, "model.safetensors")) for d in (out, ppo_two_ranks)))


def test_rollout_tp_2_samples_and_trains_as_one_engine_per_rank(ppo_two_ranks, dead_rank):
    """ppo_two_ranks generates with one vLLM engine sharded over both ranks (rollout_tp 2: each rank's prompts
    gathered, generated together, each rank keeping its own), the dead-rank run's step 1 with one engine a rank:
    the same samples (lengths, rewards), the same losses and grad norms, and every sync into the sharded engine
    verified (checksums, and its probe log-probs within verify_tol of the trainer's)."""
    assert json.load(open(ppo_two_ranks / "config.json"))["rollout_tp"] == 2
    tp, per_rank = records(ppo_two_ranks)[1], records(dead_rank[0])[1]
    for key in ("response_length/mean", "response_length/max", "critic/score/mean", "critic/score/min",
                "critic/score/max", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm",
                "actor/reward_kl_penalty"):
        assert tp[key] == pytest.approx(per_rank[key], abs=1e-6), key
    for r in records(ppo_two_ranks)[1:]:
        assert 0 <= r["reshard/probe_logprob_diff_max"] <= 1e-4, r["reshard/probe_logprob_diff_max"]


MIXED_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 3 == 0:
        return 1.0
    if extra_info["index"] % 3 == 1:
        return 0.0
    return float(len(solution_str) % 2)
"""
STUCK_TIMEOUT_S = 20  # dist_timeout_s of the run whose rank hangs (the 1-process run fills the wait)


def dynamic_args(setup: dict, root, out_dir, **overrides) -> list[str]:
    """GRPO with dynamic sampling on MIXED_REWARD (written to root): two thirds of the prompts give groups with equal
    rewards."""
    (root / "mixed.py").write_text(MIXED_REWARD)
    return args({**setup, "reward_fn_path": str(root / "mixed.py")}, out_dir, max_gen_rounds=12,
                dynamic_sampling=True, **overrides)


@pytest.fixture(scope="module")
def dynamic_runs(tiny_rl_setup, tmp_path_factory):
    """The runs of the two tests below, at once: on 2 ranks, dynamic sampling fills step 1, then rank 1 hangs at the
    start of step 2 (tests/dist_rank_fault.py); while rank 0 waits dist_timeout_s for it (the CPUs idle), the same
    first step runs in 1 process. Each run's folder, and the 2-rank run's log."""
    root = tmp_path_factory.mktemp("dynamic")
    argv = dynamic_args(tiny_rl_setup, root, root / "two", total_steps=2, dist_timeout_s=STUCK_TIMEOUT_S)
    one_argv, one = dynamic_args(tiny_rl_setup, root, root / "one", total_steps=1), []
    log = run_with_fault(argv, root / "two.log", "1:2:hang", timeout_s=STUCK_TIMEOUT_S + 60,
                         meanwhile=lambda: one.append(launch(one_argv, root / "one.log", wait=False)))
    finished(one[0], root / "one.log")
    return dict(one=root / "one", two=root / "two", log=log)


def test_stuck_rank_is_named_after_dist_timeout(dynamic_runs):
    """Rank 1 of the 2-rank run is alive but takes no part: rank 0's collective times out and it names rank 1."""
    log = dynamic_runs["log"]
    assert "RankFailure: rank 0 stops: rank 1 is alive but did not take part" in log, log[-3000:]
    assert "Timed out" in log  # gloo's error, after dist_timeout_s


def test_dynamic_sampling_fills_both_ranks_with_informative_groups(dynamic_runs):
    """Two thirds of the prompts give groups with equal rewards: on 1 process and on 2 ranks alike, the step ends
    with train_batch_size informative groups (none filled in), every rank running the same rounds."""
    for out in (dynamic_runs["one"], dynamic_runs["two"]):
        step = records(out)[1]
        assert step["dynamic/kept_groups"] == 8 and step["dynamic/filled_groups"] == 0, step
        assert step["dynamic/rounds"] >= 2 and step["dynamic/dropped_groups"] >= 6
