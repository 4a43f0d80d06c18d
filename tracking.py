"""Where a run's metrics go besides metrics.jsonl and curves.png (always written): a console line a step,
TensorBoard, wandb. Rank 0 only (the loop builds it there); verl's metric names.

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

Backend = Literal["console", "tensorboard", "wandb"]
CONSOLE = {"critic/score/mean": "reward", "val/accuracy": "acc", "actor/pg_loss": "pg_loss",
           "actor/entropy": "entropy", "response_length/mean": "len", "timing_s/step": "s"}  # name: short name


class Tracking:
    def __init__(self, backends: tuple[Backend, ...], out_dir: str, project: str, name: str, config: dict):
        self.backends = backends
        self.tb = self.wandb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        if "wandb" in backends:
            import wandb

            # no key: offline, in out_dir/wandb (`wandb sync` uploads it later); never a login prompt
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self.wandb = wandb.init(project=project, name=name, dir=out_dir, config=config, mode=mode)

    def log(self, metrics: dict, step: int) -> None:
        numbers = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if "console" in self.backends:
            shown = " ".join(f"{short}={numbers[k]:.4g}" for k, short in CONSOLE.items() if k in numbers)
            from tqdm import tqdm

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
            self.wandb.finish()
