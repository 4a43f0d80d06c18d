"""What a run records: a step's data metrics (batch_metrics, on every rank before the reduction), and on rank 0 a
console line a step, TensorBoard, wandb (Tracking), curves.png (plot_curves), summary.json (run_summary) and the
warnings a person should see (step_warnings); verl's metric names.

    python grpo.py --logger console tensorboard          # out/grpo/tensorboard/: tensorboard --logdir out/grpo
    python grpo.py --logger wandb                        # online with WANDB_API_KEY set, else offline in out/grpo/wandb
    wandb sync out/grpo/wandb/offline-run-*              # upload an offline run later

API:
    tracker = Tracking(("tensorboard", "wandb"), out_dir, project="nanoverl", name="grpo", config=asdict(cfg))
    tracker.log({"critic/score/mean": 0.5, ...}, step)   # numbers only; other values are skipped
    tracker.close()
"""

import math
import os
from typing import Literal

import torch
from tensordict import TensorDict
from tqdm import tqdm

from batching import response_lengths
from comm import Max, Min

Backend = Literal["console", "tensorboard", "wandb"]
CONSOLE = {"critic/score/mean": "reward", "val/accuracy": "acc", "actor/pg_loss": "pg_loss",
           "actor/entropy": "entropy", "response_length/mean": "len", "timing_s/step": "s"}  # name: short name
TRUNCATED_WARN = 0.5  # a share of responses cut at max_response_length worth a word


class Tracking:
    def __init__(self, backends: tuple[Backend, ...], out_dir: str, project: str, name: str, config: dict):
        self.backends = backends
        self.tb = self.wandb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        if "wandb" in backends:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"  # never a login prompt
            self.wandb = wandb.init(project=project, name=name, dir=out_dir, config=config, mode=mode)

    def log(self, metrics: dict, step: int) -> None:
        numbers = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if "console" in self.backends:
            shown = " ".join(f"{short}={numbers[k]:.4g}" for k, short in CONSOLE.items() if k in numbers)
            tqdm.write(f"step {step}: {shown}")  # above the progress bar, not through it
        if self.tb is not None:
            for k, v in numbers.items():
                if math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            import wandb

            self.wandb.finish()
            wandb.teardown()  # finish() can return before wandb's service has written the offline run's file


def plot_curves(records: list[dict], path: str):
    """curves.png: training reward and held-out accuracy against step (with tools, the tool-call rates beside; with
    a learned reward model, the verifier's score of the same samples: their gap is reward hacking)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label, marker in ((ax1, "critic/score/mean", "mean reward", None),
                                   (ax1, "reward_model/rule_score/mean", "the verifier's score (vs the reward model)",
                                    None),
                                   (ax1, "tool_calls/rate", "tool-call rate", None),
                                   (ax2, "val/accuracy", "greedy accuracy", "o"),
                                   (ax2, "val/tool_call_rate", "greedy tool-call rate", "s")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), marker=marker, label=label)
    ax1.set(xlabel="step", title="training (sampled)")
    ax2.set(xlabel="step", title="held-out (greedy)", ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_summary(records: list[dict], out_dir: str, wall_s: float) -> dict:
    """What a finished run did (summary.json). wall_s is this process's; nested phases (reshard inside gen) count
    in both phase shares; best_checkpoint is None when no checkpoint was kept at the best step."""
    steps = [r for r in records if r["step"] > 0]
    step_s = sum(r.get("timing_s/step", 0.0) for r in steps)
    phases = sorted({k for r in steps for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    tokens = sum(r.get("perf/throughput", 0.0) * r.get("timing_s/step", 0.0) for r in steps)
    best = max((r for r in records if "val/accuracy" in r), key=lambda r: (r["val/accuracy"], r["step"]))
    folder = os.path.join(out_dir, "checkpoints", f"step_{best['step']}")
    if not os.path.isdir(folder):
        folder = os.path.join(out_dir, "final") if best["step"] == records[-1]["step"] else None
    return {"steps": len(steps), "wall_s": wall_s, "step_s": step_s,
            "phase_share": {k[len("timing_s/"):]: sum(r.get(k, 0.0) for r in steps) / max(step_s, 1e-9)
                            for k in phases},
            "tokens_per_s_per_rank": tokens / max(step_s, 1e-9),
            "peak_memory_gb": {k[len("perf/max_memory_gb/"):]: max(r.get(k, 0.0) for r in records)
                               for k in sorted({k for r in records for k in r if k.startswith("perf/max_memory_gb/")})},
            "mfu": {k[len("perf/mfu/"):]: sum(r[k] for r in steps if k in r) / len(steps)
                    for k in sorted({k for r in steps for k in r if k.startswith("perf/mfu/")})},
            "overhead_share": sum(r.get("perf/overhead_share", 0.0) for r in steps) / max(len(steps), 1),
            "skipped_steps": sum(v for r in steps for k, v in r.items() if k.endswith("/skipped_steps")),
            "best_val_accuracy": best["val/accuracy"], "best_step": best["step"], "best_checkpoint": folder}


def step_warnings(record: dict, previous: dict) -> list[str]:
    """What a person should see about one step, beside the progress bar: skipped optimizer steps and non-finite
    metrics whenever they happen; many truncated responses when the share first crosses TRUNCATED_WARN (again only
    after it fell back below)."""
    step = record["step"]
    out = [f"step {step}: {key.split('/')[0]} skipped {n:.0f} optimizer step(s): a non-finite gradient"
           for key, n in record.items() if key.endswith("/skipped_steps") and n]
    bad = sorted(k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v))
    if bad:
        out.append(f"step {step}: non-finite metrics: {', '.join(bad)}")
    share = record.get("response_length/clip_ratio", 0.0)
    if share >= TRUNCATED_WARN > previous.get("response_length/clip_ratio", 0.0):
        out.append(f"step {step}: {share:.0%} of the responses hit max_response_length (cut before EOS): raise "
                   "--max-response-length, or shape long answers (--overlong-buffer-len, --mask-truncated)")
    return out


def stats(name: str, x: torch.Tensor) -> dict:
    """verl's name/mean, name/max, name/min of x."""
    return {f"{name}/mean": x.mean().item(), f"{name}/max": Max(x.max().item()), f"{name}/min": Min(x.min().item())}


def batch_metrics(batch: TensorDict, max_response_length: int) -> dict:
    """verl's data metrics of one step: rewards, advantages, returns, values, lengths, engine/trainer log-prob gap;
    with tools, turns, calls and errors per response and the share of response tokens that are a tool's."""
    mask = batch["response_mask"]
    real = mask.bool()  # [B, R]: the model's tokens
    lengths = response_lengths(batch).float()  # [B]: a tool's tokens too
    out = stats("critic/score", batch["scores"])  # [B]: one per response
    if "old_log_probs" in batch.keys():  # recomputed (else the actor's update measures the gap)
        gap = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * mask  # [B, R]
        out["rollout/logprob_diff_max"] = Max(gap.max().item())
        out["rollout/logprob_diff_mean"] = (gap.sum() / mask.sum().clamp(min=1)).item()
    for name in ("advantages", "returns", "values"):  # [B, R]: over the real tokens
        if name in batch.keys():
            out.update(stats(f"critic/{name}", batch[name][real]))
    if "values" in batch.keys():  # the share of the returns' variance that the values explain (1: all of it)
        returns, values = batch["returns"][real], batch["values"][real]
        out["critic/vf_explained_var"] = (1 - (returns - values).var() / returns.var().clamp(min=1e-8)).item()
    if "num_turns" in batch.keys():  # multi-turn (agent.py)
        calls = batch["tool_calls"].float()  # [B]
        out.update(stats("num_turns", batch["num_turns"].float()))
        out.update({"tool_calls/mean": calls.mean().item(), "tool_calls/rate": (calls > 0).float().mean().item(),
                    "tool_errors/mean": batch["tool_errors"].float().mean().item(),
                    "response_length/observation_share": (1 - mask.sum() / lengths.sum().clamp(min=1)).item()})
    return {**out, "response_length/mean": lengths.mean().item(), "response_length/max": Max(lengths.max().item()),
            "response_length/clip_ratio": (lengths >= max_response_length).float().mean().item(),
            "prompt_length/mean": (batch["attention_mask"].sum(-1) - lengths).float().mean().item()}
