"""FSDP2 memory and step time: one plain process vs 2 torchrun ranks (dp 2, and tp 2: training tensor parallelism),
same Qwen2, same global batch, one run.

    OMP_NUM_THREADS=1 python bench/fsdp.py                       # ~99M parameters (hidden 768, 12 layers, vocab 32k)
    OMP_NUM_THREADS=1 python bench/fsdp.py --hidden-size 256 --num-layers 4 --intermediate-size 704   # ~10M, quick

The model is built from a config with random weights and saved once; then this file runs itself as a measuring
worker twice: `python bench/fsdp.py --worker-out ...` (no process group: the plain model) and
`torchrun --nproc_per_node=2 bench/fsdp.py --worker-out ...` twice: dp 2 (FSDP2 through sharding.load_sharded_model,
each rank on half of the batch) and tp 2 (--tp-size 2: each decoder layer split over both ranks, which both take the
whole batch; TP is not expected to win on 2 CPU cores, the column says what it costs). Each worker trains (AdamW,
fp32) one untimed step and `steps` timed ones.
Per rank it reports: parameters + optimizer state held locally (the sum of local tensor sizes: ~1/N of the
total when sharded), RSS before the model is built (Python, torch, transformers, the process group: the
floor under every number below), peak RSS (ru_maxrss, the high-water mark: rank 0 also held the full model
while loading), RSS after training, and step time.
The 2-rank column is the largest value over the ranks. On a shared 2-core machine run it with OMP_NUM_THREADS=1.
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, not bench/

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import tyro  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from comm import broadcast_object, init_distributed, shutdown  # noqa: E402
from sharding import FSDPConfig, clip_grad_norm, load_sharded_model  # noqa: E402

MB = 1 << 20


@dataclass
class BenchConfig:
    hidden_size: int = 768
    """Model width (head size 64)."""
    num_layers: int = 12
    """Decoder layers."""
    intermediate_size: int = 2048
    """MLP width."""
    vocab_size: int = 32000
    """Vocabulary (tied input/output embeddings)."""
    batch_size: int = 4
    """Sequences per optimizer step, the global batch (2 ranks take half each)."""
    seq_len: int = 128
    """Tokens per sequence."""
    steps: int = 3
    """Timed steps, after one untimed warm-up step."""
    worker_out: str | None = None
    """Internal: set by the launcher; run as a measuring worker and write its numbers to this JSON file."""
    model_dir: str | None = None
    """Internal: the saved model the workers load."""
    tp_size: int = 1
    """Internal: the workers' tensor-parallel size (fsdp.tp_size)."""


def local_bytes(tensors) -> int:
    """Bytes this rank holds: a DTensor counts its local shard only."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def rss_mb() -> float:
    """Resident memory now (ru_maxrss only gives the high-water mark)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def worker(cfg: BenchConfig) -> None:
    dist = init_distributed(tp=cfg.tp_size)
    base_rss = rss_mb()  # interpreter + torch + transformers + process group, before any weight
    model = load_sharded_model(cfg.model_dir, dist, FSDPConfig(tp_size=cfg.tp_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    input_ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len),
                              generator=torch.Generator().manual_seed(0))  # [B, T]
    rows = input_ids.chunk(dist.dp_size)[dist.dp_rank]  # [B/dp, T]
    times = []
    for _ in range(cfg.steps + 1):
        start = time.perf_counter()
        logits = model(input_ids=rows, use_cache=False).logits  # [B/dp, T, V]
        F.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten()).backward()
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    optim_tensors = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    mine = {"params_mb": local_bytes(model.parameters()) / MB, "optim_mb": local_bytes(optim_tensors) / MB,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
            "base_rss_mb": base_rss, "end_rss_mb": rss_mb(), "step_s": sum(times[1:]) / cfg.steps}
    everyone = [broadcast_object(mine, dist, src=r) for r in range(dist.world_size)]
    if dist.is_main:
        Path(cfg.worker_out).write_text(json.dumps(everyone))
    shutdown(dist)


def launch(cfg: BenchConfig, model_dir: str, nproc: int, out: str, tp: int = 1) -> list[dict]:
    """Run this file as a worker: plainly for 1 process, through torchrun (a free port) for more."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in asdict(replace(cfg, tp_size=tp)).items() if v is not None]
    flags += [f"--model-dir={model_dir}", f"--worker-out={out}"]
    runner = [] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                    "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"]
    subprocess.run([sys.executable, *runner, __file__, *flags], check=True)
    return json.loads(Path(out).read_text())


def main(cfg: BenchConfig) -> None:
    config = Qwen2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.hidden_size // 64,
                         num_key_value_heads=2, tie_word_embeddings=True)  # 2 kv heads: tp 2 splits them
    with tempfile.TemporaryDirectory() as tmp:
        model = Qwen2ForCausalLM(config)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        one = launch(cfg, tmp, 1, os.path.join(tmp, "one.json"))[0]
        two = launch(cfg, tmp, 2, os.path.join(tmp, "two.json"))
        tp = launch(cfg, tmp, 2, os.path.join(tmp, "tp.json"), tp=2)
    worst = {name: {k: max(rank[k] for rank in ranks) for k in one} for name, ranks in (("dp", two), ("tp", tp))}
    print(f"\n{n_params / 1e6:.1f}M-parameter Qwen2 (hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab "
          f"{cfg.vocab_size}), fp32 AdamW, global batch {cfg.batch_size} x {cfg.seq_len} tokens, "
          f"mean of {cfg.steps} steps; 2 ranks: the largest rank")
    print(f"{'per rank':<26} {'1 process':>10} {'dp 2':>10} {'dp / 1':>7} {'tp 2':>10} {'tp / 1':>7}")
    for key, label in (("params_mb", "parameters (MB)"), ("optim_mb", "optimizer state (MB)"),
                       ("base_rss_mb", "RSS before the model (MB)"), ("peak_rss_mb", "peak RSS (MB)"),
                       ("end_rss_mb", "RSS after training (MB)"),
                       ("step_s", "step time (s)")):
        dp, tp2 = worst["dp"][key], worst["tp"][key]
        print(f"{label:<26} {one[key]:>10.1f} {dp:>10.1f} {dp / one[key]:>7.2f} {tp2:>10.1f} {tp2 / one[key]:>7.2f}")
    for name, ranks in (("dp 2", two), ("tp 2", tp)):
        shards = sum(rank["params_mb"] + rank["optim_mb"] for rank in ranks)
        print(f"parameters + optimizer state, summed over the 2 ranks ({name}) / 1 process: "
              f"{shards / (one['params_mb'] + one['optim_mb']):.3f}")


if __name__ == "__main__":
    cli = tyro.cli(BenchConfig)
    worker(cli) if cli.worker_out else main(cli)
