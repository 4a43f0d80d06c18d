"""The GPU path end to end in a few minutes: a model of Qwen2.5-0.5B's shapes through GRPO steps, a resume, FSDP2 with
every role offloaded, and the checks a CPU test cannot make.

    python bench/gpu_smoke.py                        # on a GPU machine (~3 min on one H200)
    python bench/gpu_smoke.py --size tiny            # the same runs and checks on CPU, with a tiny model (~1 min)
    python bench/gpu_smoke.py --tp 2                 # the fsdp run with training TP over 2 GPUs

The model is made here (random init, no download): Qwen2.5-0.5B's shapes (vocabulary 151,936, hidden 896, 24 layers,
14 heads, 2 KV heads, MLP 4,864, tied embeddings), with the byte tokenizer padded to that vocabulary; the task is
the built-in arithmetic one, scored by a dense reward written here (the share of even-numbered filler tokens in a
response: a random policy's rewards differ within a group, so every update has a gradient). The engine is vLLM when
it is installed, else HF generate (--rollout-backend hf). Runs, each a process of its own:
  1. plain:   one process (autocast bf16, gradient checkpointing), `steps` GRPO steps, a checkpoint at step 2
  2. resume:  the same command with one more step: it must resume from step 2's checkpoint and run steps 3..
  3. fsdp:    torchrun (one rank per GPU, at most 2; 1 on a single GPU): FSDP2, bf16, gradient checkpointing, the KL
              loss (a reference), every role's parameters and optimizer state offloaded between phases
Asserted in every run: the rollout engine sits on the device of LOCAL_RANK; every worker method returns CPU tensors;
the offloaded models' parameters are back in host memory after each phase, the optimizer still holds the model's
own parameters, and an update moves them; every metric is finite; the resumed run starts where the checkpoint
left off. Printed: per phase the seconds, tokens/s, peak memory (torch.cuda.max_memory_allocated over the call)
and MFU (perf.model_flops of the call's batch: the runs' own perf/mfu/* count the same) against the device's dense
bf16 peak (perf.peak_flops: its table by name, else a matmul measured once and cached).
"""

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's modules, not bench/

import torch  # noqa: E402
import tyro  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from perf import device_name, model_flops, peak_flops  # noqa: E402

SHAPES = {  # Qwen2Config fields
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1e6, rms_norm_eps=1e-6),
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=512),  # 2 kv heads: --tp 2 splits them
}
REWARD = '''import re
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    ids = [int(i) for i in re.findall(r"filler(\\d+)", solution_str)]
    return sum(i % 2 == 0 for i in ids) / max(len(ids), 1)
'''
CHECKED = {"ActorWorker": ("generate", "log_probs", "ref_log_probs", "update"), "CriticWorker": ("values", "update")}


@dataclass
class SmokeConfig:
    size: Literal["qwen2.5-0.5b", "tiny"] = "qwen2.5-0.5b"
    """Model shapes (SHAPES): tiny for a CPU dry run."""
    steps: int = 3
    """GRPO steps of the first run (a checkpoint at step 2); the resumed run adds one."""
    prompts: int = 8
    """Prompts a step (train_batch_size), 4 samples each."""
    response_tokens: int = 128
    """Tokens every response runs to (--ignore-eos: a fixed workload)."""
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """The rollout engine: auto is vLLM when it is installed, else HF generate."""
    out_dir: str = "out/gpu_smoke"
    """Where the model, the task, the runs and summary.txt go."""
    tp: int = 1
    """The fsdp run's training tensor parallelism (--fsdp.tp-size) on that many GPUs, all one tp group (dp 1, so
    HF generate, which runs in one dp rank, can serve it)."""
    worker_out: str | None = None
    """Internal: run one training command (the flags after --) with the checks installed; write them here."""


# ---------------------------------------------------------------------------------------------------
# The worker side: one training command with the checks installed
# ---------------------------------------------------------------------------------------------------


def cpu_tensors(x) -> list[torch.Tensor]:
    """Every tensor in a worker's return value (a tensor, a TensorDict, a tuple of them)."""
    if isinstance(x, tuple):
        return [t for part in x for t in cpu_tensors(part)]
    if isinstance(x, TensorDict):
        return list(x.values())
    return [x] if torch.is_tensor(x) else []


def check_call(worker, name: str, fn, args, kwargs, record: list):
    """Run worker.name(*args), time it and its peak memory; assert its tensors come back on the CPU and what it
    offloads is back in host memory."""
    from comm import synchronize

    cuda = worker.dist.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = next(worker.model.parameters()).detach().float().sum().item() if name == "update" else None
    synchronize()
    start = time.perf_counter()
    out = fn(worker, *args, **kwargs)
    synchronize()
    seconds = time.perf_counter() - start
    wrong = [t.device for t in cpu_tensors(out) if t.device.type != "cpu"]
    assert not wrong, f"{worker.role}.{name} returned tensors on {wrong}"
    offloaded = [worker.model] if worker.offload_params else []
    offloaded += [worker.ref] if getattr(worker, "ref", None) is not None and worker.cfg.offload.ref_params else []
    for model in offloaded:
        assert {p.device.type for p in model.parameters()} == {"cpu"}, f"{worker.role}.{name}: params left on device"
    held = {id(p) for group in worker.opt.param_groups for p in group["params"]}
    assert held == {id(p) for p in worker.model.parameters()}, f"{worker.role}: the optimizer lost the parameters"
    if before is not None:
        assert next(worker.model.parameters()).detach().float().sum().item() != before, "the update moved nothing"
    batch = args[0] if args and isinstance(args[0], TensorDict) else None
    backward = name == "update"
    flops = 0.0 if batch is None else (worker.cfg.ppo_epochs if backward else 1) * model_flops(
        batch["attention_mask"].sum(-1), worker.shape, backward, lora=bool(worker.cfg.lora))
    record.append(dict(phase=f"{worker.role}.{name}", seconds=seconds, flops=flops,
                       tokens=int(batch["attention_mask"].sum()) if batch is not None else
                       int(out[0]["response_mask"].sum()) if name == "generate" else 0,
                       peak_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")))
    return out


def install_checks(record: list, facts: dict) -> None:
    """Wrap the workers' methods (check_call) and their construction (the engine's device)."""
    import workers
    from rollout import HFRollout

    local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    actor_init = workers.ActorWorker.__init__

    def init(self, *args, **kwargs):
        actor_init(self, *args, **kwargs)
        engine = self.rollout.device if isinstance(self.rollout, HFRollout) else torch.device(self.rollout.device)
        assert local is None or engine == local, f"the rollout engine is on {engine}, LOCAL_RANK's is {local}"
        facts.update(engine_device=str(engine), parameters=sum(p.numel() for p in self.model.parameters()))

    workers.ActorWorker.__init__ = init
    for cls_name, methods in CHECKED.items():
        cls = getattr(workers, cls_name)
        for name in methods:
            def wrapped(self, *args, _fn=getattr(cls, name), _name=name, **kwargs):
                return check_call(self, _name, _fn, args, kwargs, record)
            setattr(cls, name, wrapped)


def worker_main(out_path: str, flags: list[str]) -> None:
    import ppo
    from config import Config

    record, facts = [], {}
    install_checks(record, facts)
    records = ppo.train(tyro.cli(Config, args=flags))
    bad = [(r["step"], k) for r in records for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
    assert not bad, f"non-finite metrics: {bad}"
    if int(os.environ.get("RANK", 0)) == 0:
        Path(out_path).write_text(json.dumps(dict(calls=record, steps=[r["step"] for r in records], **facts)))


# ---------------------------------------------------------------------------------------------------
# The launcher: model, task, the three runs, the summary
# ---------------------------------------------------------------------------------------------------


def make_inputs(cfg: SmokeConfig) -> dict:
    """The model folder (random weights at SHAPES[size], the padded byte tokenizer), the task, the reward file."""
    from data.arith import ArithConfig, write_parquet
    from tiny import build_byte_tokenizer

    root = Path(cfg.out_dir)
    shapes = SHAPES[cfg.size]
    tokenizer = build_byte_tokenizer(shapes["vocab_size"])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(Qwen2Config(**shapes, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.pad_token_id)).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    del model
    train, val = write_parquet(ArithConfig(out_dir=str(root / "data"), n_train=256, n_val=16))
    (root / "reward.py").write_text(REWARD)
    return dict(model_path=str(root / "model"), train_files=train, val_files=val,
                reward_fn_path=str(root / "reward.py"))


def flags(inputs: dict, cfg: SmokeConfig, out: str, **extra) -> list[str]:
    run = dict(inputs, out_dir=out, adv_estimator="grpo", total_steps=cfg.steps, ckpt_every=2, eval_every=100,
               val_size=8, train_batch_size=cfg.prompts, ppo_mini_batch_size=cfg.prompts, rollout_n=4,
               max_prompt_length=64, max_response_length=cfg.response_tokens, lr=1e-5, ppo_micro_batch_size=8,
               overwrite=True)
    run.update(extra)
    out = [f"--{k.replace('_', '-')}={v}" for k, v in run.items() if not isinstance(v, bool)]
    out += [f"--{k.replace('_', '-')}" for k, v in run.items() if v is True]
    return out + ["--ignore-eos", "--gradient-checkpointing", "--fsdp.param-dtype=bfloat16",
                  "--hybrid.verify-sync", "--hybrid.verify-tol=0.05"]  # bf16: the probe's gap is ~1e-2


def launch(cmd: list[str], name: str, root: Path) -> dict:
    """Run one training command with the checks; its output in root/<name>.log; returns what it recorded."""
    result = root / f"{name}.json"
    result.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(root / f"{name}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    text = (root / f"{name}.log").read_text()
    if proc.returncode != 0:
        sys.exit(f"{name} failed (exit {proc.returncode}); the end of {root / (name + '.log')}:\n{text[-4000:]}")
    print(f"{name}: ok in {time.perf_counter() - start:.0f} s")
    return {**json.loads(result.read_text()), "log": text}


def summary(runs: dict, peak: float, peak_name: str) -> str:
    """Per run and phase: calls, seconds, tokens/s, peak memory, MFU (generation: none)."""
    lines = [f"device: {peak_name}", f"{'run':7} {'phase':22} {'calls':>5} {'s/call':>8} {'tokens/s':>10} "
                                     f"{'peak GB':>8} {'MFU':>6}"]
    for run, data in runs.items():
        phases = {}
        for call in data["calls"]:
            phases.setdefault(call["phase"], []).append(call)
        for phase, calls in phases.items():
            seconds, tokens = sum(c["seconds"] for c in calls), sum(c["tokens"] for c in calls)
            flops = sum(c["flops"] for c in calls)
            mfu = flops / seconds / peak if flops else float("nan")
            lines.append(f"{run:7} {phase:22} {len(calls):5d} {seconds / len(calls):8.3f} {tokens / seconds:10.0f} "
                         f"{max(c['peak_gb'] for c in calls):8.2f} {mfu:6.1%}")
    return "\n".join(lines)


def main(cfg: SmokeConfig) -> None:
    root = Path(cfg.out_dir)
    root.mkdir(parents=True, exist_ok=True)
    inputs = make_inputs(cfg)
    backend = cfg.backend
    if backend == "auto":  # vLLM where it is installed
        backend = "vllm" if importlib.util.find_spec("vllm") else "hf"
    me = [sys.executable, str(Path(__file__).resolve())]
    plain = flags(inputs, cfg, str(root / "plain"), rollout_backend=backend, resume="off")
    runs = {"plain": launch(me + ["--worker-out", str(root / "plain.json"), "--"] + plain, "plain", root)}
    assert runs["plain"]["steps"][-1] == cfg.steps
    resumed = flags(inputs, cfg, str(root / "plain"), rollout_backend=backend, total_steps=cfg.steps + 1,
                    overwrite=False)
    runs["resume"] = launch(me + ["--worker-out", str(root / "resume.json"), "--"] + resumed, "resume", root)
    assert "resumed from" in runs["resume"]["log"] and "step_2" in runs["resume"]["log"], "no resume from step 2"
    assert runs["resume"]["steps"] == list(range(cfg.steps + 2)), runs["resume"]["steps"]  # 0..2 kept, then 3..
    gpus = torch.cuda.device_count()
    ranks = min(max(gpus, 1), 2) if backend == "vllm" else 1  # HF generate runs in one dp rank only
    if cfg.tp > 1:
        ranks = cfg.tp  # one tp group: every rank samples the same prompts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    offload = [f"--offload.{k}" for k in ("actor-params", "actor-optimizer", "ref-params")]
    fsdp = flags(inputs, cfg, str(root / "fsdp"), rollout_backend=backend, total_steps=2, use_kl_loss=True,
                 resume="off", **({"fsdp.tp_size": cfg.tp} if cfg.tp > 1 else {})) + offload
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}"]
    runs["fsdp"] = launch(torchrun + me[1:] + ["--worker-out", str(root / "fsdp.json"), "--"] + fsdp, "fsdp", root)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = peak_flops(device, torch.bfloat16)
    peak_name = f"{device_name(device)}, bf16 peak {peak / 1e12:.3g} TFLOP/s (perf.peak_flops)"
    text = (f"engine: {backend} on {runs['plain']['engine_device']} (fsdp run: {ranks} rank(s), "
            f"{runs['fsdp']['engine_device']}); {runs['plain']['parameters'] / 1e6:.0f}M parameters\n"
            + summary({k: v for k, v in runs.items()}, peak, peak_name) + "\nall checks passed")
    (root / "summary.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    smoke = tyro.cli(SmokeConfig, args=argv[: argv.index("--")] if "--" in argv else argv)
    if smoke.worker_out:
        worker_main(smoke.worker_out, rest)
    else:
        main(smoke)
