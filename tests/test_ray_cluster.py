"""The cluster recipe for real: scripts/slurm_ray.sh without Slurm starts a Ray head and one more Ray node on this
machine (`ray start`, one CPU each), waits for both, runs ray_trainer.py on them (the actor pool's two workers on
different nodes) and stops both nodes at exit, leaving no Ray process behind.

    python -m pytest tests/test_ray_cluster.py -q
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import tyro

from config import BUILTIN_TASK
from ray_trainer import RayTrainerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours(ray_tmp: str) -> list[int]:
    """The live processes of the cluster that uses Ray's temp dir ray_tmp: those with RAY_TMPDIR=ray_tmp in their
    environment, or with a file open under it (Ray's agents get an environment of their own, but every Ray process
    keeps its log files open). Zombies do not count: exited processes whose parent died, left for init to reap."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                mine = f"RAY_TMPDIR={ray_tmp}".encode() in f.read().split(b"\0")
            if mine or any(path.startswith(ray_tmp + "/") for path in open_files(pid)):
                pids.append(int(pid))
        except OSError:  # gone, or not ours to read
            pass
    return pids


def open_files(pid: str) -> list[str]:
    """The paths of the process's open files (each fd read on its own: one may close meanwhile)."""
    paths = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return paths


def test_the_slurm_script_runs_a_pool_across_two_local_nodes(tiny_rl_setup, tmp_path):
    with socket.socket() as s:  # a free GCS port: another Ray on this machine may hold 6379
        s.bind(("", 0))
        port = s.getsockname()[1]
    # Ray's temp dir of our own, short (Unix socket paths under it must stay under 108 bytes); it marks our processes
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # local mode, even inside a Slurm job
    env.update(NODES="2", PORT=str(port), RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", JOIN_TIMEOUT_S="120")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # this python's ray, python
    run = {**BUILTIN_TASK, **tiny_rl_setup, "train_batch_size": 8, "ppo_mini_batch_size": 4, "rollout_n": 4,
           "max_response_length": 6, "total_steps": 2, "eval_every": 2, "adv_estimator": "grpo",
           "out_dir": str(tmp_path)}  # conftest.toy_config's run, as flags (with --model-path no task values apply)
    flags = [x for k, v in run.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    log = tmp_path / "script.log"  # a file, not a pipe: a process left behind would hold a pipe open
    with open(log, "w") as f:
        script = subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "slurm_ray.sh"), *flags, "--ray.workers", "2",
                                   "--ray.strategy", "STRICT_SPREAD"], cwd=tmp_path, env=env, stdout=f,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        script.wait(timeout=300)
        deadline = time.time() + 15  # the nodes' last processes may take a moment to exit
        while (left := ours(ray_tmp)) and time.time() < deadline:
            time.sleep(0.5)
    finally:
        if script.poll() is None:  # timed out: the script's process group, then whatever it left
            os.killpg(script.pid, signal.SIGTERM)
            script.wait(30)
        for pid in ours(ray_tmp):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = log.read_text()
    assert script.returncode == 0, out[-5000:]
    assert "[slurm_ray] all 2 nodes joined" in out
    assert not left, f"Ray processes left behind: {left}"
    placed = re.findall(r"\[ray\] actor rank (\d): node (\w+)", out)
    assert sorted(rank for rank, _ in placed) == ["0", "1"], out[-5000:]
    assert len({node for _, node in placed}) == 2, placed  # one worker on each node
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [0, 1, 2] and "val/accuracy" in records[-1]
    assert os.path.exists(os.path.join(tmp_path, "final", "model.safetensors"))


def test_the_dashboard_flag():
    assert not tyro.cli(RayTrainerConfig, args=[]).ray.dashboard  # off by default, as before
    assert tyro.cli(RayTrainerConfig, args=["--ray.dashboard"]).ray.dashboard
