"""Weight sync into vLLM on 2 torchrun ranks: the hybrid engine against the naive path and the communication floor.

    OMP_NUM_THREADS=1 python bench/reshard.py                    # ~10M, ~100M and ~300M-parameter Qwen2s, fp32 and bf16
    OMP_NUM_THREADS=1 python bench/reshard.py --sizes 10m --dtypes float32   # one model, one dtype, quick
    OMP_NUM_THREADS=1 python bench/reshard.py --layouts dp2 tp2-full tp2-slices --dtypes float32   # training TP

For each size the launcher builds a Qwen2 from a config (random weights, tied embeddings, vocab 32k) and saves it;
for each rollout dtype it runs this file under `torchrun --nproc_per_node=2` as the measuring workers. The trainer's
master weights are fp32; the rollout dtype is the engine's, hence what the hybrid engine streams (its shards are
cast before the gather) and the floor's bytes; bf16 is the usual production setting (workers.py's engine computes in
--fsdp.param-dtype). Each rank holds the FSDP2-sharded model (sharding.load_sharded_model) and its own in-process
vLLM engine (rollout.VLLMRollout), and times, after one untimed round, `repeats` rounds of each way of putting the
trainer's weights into the engines:
- hybrid:       HybridEngine.rollout_mode with 512 MB buckets (whole decoder layers, full_tensor() per parameter)
- hybrid/layer: the same with 1-byte buckets: one decoder layer (or other tensor) per engine call
- naive:        rank 0 gathers the full state dict (fp32 masters) and save_pretrained's it (sharding.export_hf),
                then every engine reloads from that folder, casting to its dtype (vLLM's
                reload_weights(weights_path=...)). On CPU this skips the repacked copy of a tied lm_head (the
                folder has no lm_head.weight), which then stays stale: the naive times are a lower bound for a
                correct naive path
- gather:       the hybrid engine's own gathers (sharding.full_weights, 512 MB buckets), no engine: its
                communication alone
- floor:        one all_gather_into_tensor of the bytes the engine needs (the model in the rollout dtype)
Per rank: seconds per sync, and peak extra memory during it (the process's peak RSS after a reset, minus its RSS
before: perf.reset_peak_memory / peak_memory; the heap's free pages are handed back to the OS before each
call, so that pages kept from an earlier call do not hide new ones). The tables show the slower / larger rank.

Layouts (--layouts): the sync into one vLLM engine sharded over both ranks (rollout_tp 2), one-layer buckets,
from a trainer at dp 2 (today's --rollout-tp 2: every rank gathers full tensors, vLLM cuts its half), at tp 2 with
the full path (hybrid.layout full), and at tp 2 with the slice path (each rank gathers its own blocks over "dp",
here of size 1: nothing, and hands vLLM only them). Per layout: seconds a sync, the bytes each rank handed its engine
and received through gathers (an all-gather sends what it receives), its peak extra memory against the floor (the
engine's share of the model, model / rollout_tp, plus one bucket of it), and HybridFlow's figure: the weights a rank
holds during the switch (its training shards, its engine's share, the sync's extra) over the engine's share.

Memory: the launcher watches the machine's available memory while the workers run and prints the most they took.
At 300M fp32 that was 11.3 GB for the two ranks. On a machine other jobs load, the kernel's OOM killer may SIGKILL
a rank (the largest process): the launcher then says so, with the figures, instead of a bare CalledProcessError.
"""

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, not bench/

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import tyro  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from comm import barrier, broadcast_object, init_distributed  # noqa: E402
from hybrid_engine import MB, HybridConfig, HybridEngine, release_host_memory  # noqa: E402
from perf import peak_memory, reset_peak_memory  # noqa: E402
from rollout import VLLMRollout  # noqa: E402
from sharding import DTYPES, FSDPConfig, export_hf, full_weights, load_sharded_model  # noqa: E402

# name: (hidden, layers, intermediate); head size 64, 4 query heads per KV head (2 in the layouts)
OOM_MARGIN_MB = 512  # available memory this low while the workers ran, and a rank died: the OOM killer's doing
SIZES = {"10m": (256, 4, 704), "100m": (768, 12, 2048), "300m": (1024, 24, 2816)}
VOCAB = 32000
KV_CACHE_BYTES = 64 * MB  # the engines only score the probe: a small KV cache leaves the machine's memory to the rest


@dataclass
class BenchConfig:
    sizes: tuple[str, ...] = ("10m", "100m", "300m")
    """Models to measure, from SIZES."""
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    """Rollout dtypes to measure (the engine's, the hybrid's buckets', the floor's); the masters stay fp32."""
    repeats: int = 3
    """Timed rounds per method, after one untimed round."""
    bucket_mb: float = 512.0
    """The hybrid engine's bucket size."""
    worker_out: str | None = None
    """Internal: set by the launcher; run as a measuring worker and write its numbers to this JSON file."""
    model_dir: str | None = None
    """Internal: the saved model the workers load."""
    dtype: str = "float32"
    """Internal: the rollout dtype a measuring worker uses."""
    layouts: tuple[str, ...] = ()
    """Measure these trainer layouts instead (dp2, tp2-full, tp2-slices: the module docstring); () the methods."""
    layout: str | None = None
    """Internal: the layout a measuring worker runs."""


def measure(fn, device, repeats: int) -> dict:
    """Mean seconds of fn over `repeats` calls after a warm-up, and the largest peak extra memory of a call."""
    fn()
    seconds, extra = [], 0
    for _ in range(repeats):
        release_host_memory()
        at_start = reset_peak_memory(device)
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
        extra = max(extra, peak_memory(device) - at_start)
    return {"s": sum(seconds) / repeats, "extra_mb": extra / MB}


def layout_worker(cfg: BenchConfig) -> None:
    """One layout's sync into a TP-2 engine (the module docstring); rank 0 writes both ranks' numbers."""
    tp = 1 if cfg.layout == "dp2" else 2
    dist = init_distributed(tp=tp, rollout_tp=2)
    model = load_sharded_model(cfg.model_dir, dist, FSDPConfig(tp_size=tp))
    dtype = DTYPES[cfg.dtype]
    rollout = VLLMRollout(cfg.model_dir, max_model_len=64, dtype=cfg.dtype, cpu_kv_cache_bytes=KV_CACHE_BYTES,
                          in_group=True, tp=2, shared_prompts=tp > 1)
    hybrid = HybridEngine(model, rollout, dist, HybridConfig(layout="full" if cfg.layout == "tp2-full" else "slices"),
                          dtype)
    metrics = {}

    def sync():
        with hybrid.rollout_mode(metrics):
            pass

    mine = measure(sync, dist.device, cfg.repeats)
    local = sum(p.to_local().numel() for p in model.parameters()) * dtype.itemsize  # this rank's training shards
    handed = metrics["reshard/bytes"]
    # what came through gathers: what the rank handed over beyond its own shards (an all-gather sends as much)
    mine.update(params=sum(p.numel() for p in model.parameters()), handed_mb=handed / MB, local_mb=local / MB,
                received_mb=max(0, handed - local) / MB)
    everyone = [broadcast_object(mine, dist, src=r) for r in range(dist.world_size)]
    if dist.is_main:
        Path(cfg.worker_out).write_text(json.dumps(everyone))
    barrier(dist)


def worker(cfg: BenchConfig) -> None:
    dist = init_distributed()
    model = load_sharded_model(cfg.model_dir, dist)
    dtype = DTYPES[cfg.dtype]
    rollout = VLLMRollout(cfg.model_dir, max_model_len=64, dtype=cfg.dtype, cpu_kv_cache_bytes=KV_CACHE_BYTES,
                          in_group=True)  # each rank's engine on its own device

    def hybrid_sync(bucket_mb: float):
        hybrid = HybridEngine(model, rollout, dist, HybridConfig(bucket_mb=bucket_mb), dtype)

        def sync():
            with hybrid.rollout_mode({}):
                pass
        return sync

    naive_dir = os.path.join(os.path.dirname(cfg.worker_out), "naive")

    def naive():
        export_hf(model, None, naive_dir, dist)  # rank 0 gathers and writes; a barrier at the end
        rollout.llm.collective_rpc("reload_weights", kwargs={"weights_path": naive_dir})
        rollout.llm.reset_prefix_cache()
        barrier(dist)

    n = sum(p.numel() for p in model.parameters())  # global sizes (DTensor)
    shard = math.ceil(n / dist.world_size)  # what one rank contributes

    def floor():  # both buffers are allocated inside: they are the floor's extra memory
        tdist.all_gather_into_tensor(torch.empty(shard * dist.world_size, dtype=dtype), torch.ones(shard, dtype=dtype))

    def gather():
        for bucket in full_weights(model, int(cfg.bucket_mb * MB), dtype):
            del bucket

    mine = {"params": n}
    for name, fn in (("hybrid", hybrid_sync(cfg.bucket_mb)), ("hybrid/layer", hybrid_sync(1 / MB)), ("naive", naive),
                     ("gather", gather), ("floor", floor)):
        mine[name] = measure(fn, dist.device, cfg.repeats)
    everyone = [broadcast_object(mine, dist, src=r) for r in range(dist.world_size)]
    if dist.is_main:
        Path(cfg.worker_out).write_text(json.dumps(everyone))
    barrier(dist)  # no destroy_process_group: the engine's own shutdown at exit destroys it


def save_model(size: str, root: str, kv_per_256: int = 1) -> str:
    """SIZES[size] as a Qwen2 with kv_per_256 KV heads per 256 of width (2 for the layouts: tp 2 splits them)."""
    hidden, layers, intermediate = SIZES[size]
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                         num_attention_heads=hidden // 64, num_key_value_heads=kv_per_256 * hidden // 256,
                         tie_word_embeddings=True, max_position_embeddings=512)
    model_dir = os.path.join(root, size)
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    return model_dir


def available_mb() -> float:
    """The machine's available memory (MemAvailable: free plus what the kernel can reclaim), in MB."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1024


def launch(cfg: BenchConfig, model_dir: str, dtype: str, layout: str | None = None) -> tuple[list[dict], float]:
    """The workers' numbers, and the most memory (MB) the machine lost while they ran."""
    out = f"{model_dir}-{dtype}-{layout}.json"
    flags = [f"--repeats={cfg.repeats}", f"--bucket-mb={cfg.bucket_mb}", f"--model-dir={model_dir}",
             f"--dtype={dtype}", f"--worker-out={out}"] + ([f"--layout={layout}"] if layout else [])
    at_launch = lowest = available_mb()
    done = threading.Event()

    def watch():  # sampled often enough to see the climb to an OOM kill, which takes seconds
        nonlocal lowest
        while not done.wait(0.1):
            lowest = min(lowest, available_mb())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
                         "--rdzv-endpoint=localhost:0", __file__, *flags]).returncode
    done.set()
    watcher.join()
    if rc:
        what = f"the workers measuring {Path(model_dir).name} with rollout dtype {dtype} failed (torchrun exit {rc})"
        if lowest < OOM_MARGIN_MB:
            raise SystemExit(f"bench/reshard.py: {what}: the machine ran out of memory. Available memory fell from "
                             f"{at_launch:.0f} MB at launch to {lowest:.0f} MB, so the kernel's OOM killer most likely "
                             "SIGKILLed a rank (torchrun's summary above: exitcode -9). Other processes hold the rest; "
                             "stop them, or leave the larger sizes out (--sizes 10m 100m).")
        raise SystemExit(f"bench/reshard.py: {what}, with memory to spare (available memory never fell below "
                         f"{lowest:.0f} MB): see the rank's traceback and torchrun's summary above.")
    return json.loads(Path(out).read_text()), at_launch - lowest


def layouts_main(cfg: BenchConfig) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for size in cfg.sizes:
            model_dir = save_model(size, root, kv_per_256=2)
            for dtype in cfg.dtypes:
                for layout in cfg.layouts:
                    ranks, took_mb = launch(cfg, model_dir, dtype, layout)
                    rows.append((size, dtype, layout, ranks, took_mb))
    print(f"\nWeight sync into one vLLM engine over 2 ranks (rollout_tp 2), one-layer buckets, fp32 masters, mean of "
          f"{cfg.repeats} after a warm-up; the larger rank's figures")
    print(f"{'size':<6} {'dtype':<9} {'layout':<11} {'s/sync':>7} {'handed MB':>10} {'received MB':>12} "
          f"{'extra MB':>9} {'floor MB':>9} {'resident / share':>17}")
    for size, dtype, layout, ranks, took_mb in rows:
        model_mb = ranks[0]["params"] * DTYPES[dtype].itemsize / MB
        share = model_mb / 2  # the engine's share of the model at rollout_tp 2
        layer_mb = model_mb / SIZES[size][1]  # about one decoder layer: the bucket
        worst = {k: max(r[k] for r in ranks) for k in ("s", "handed_mb", "received_mb", "extra_mb", "local_mb")}
        floor = share + layer_mb / 2
        resident = (worst["local_mb"] + share + worst["extra_mb"]) / share
        print(f"{size:<6} {dtype:<9} {layout:<11} {worst['s']:>7.3f} {worst['handed_mb']:>10.0f} "
              f"{worst['received_mb']:>12.0f} {worst['extra_mb']:>9.0f} {floor:>9.0f} {resident:>17.2f}")


def main(cfg: BenchConfig) -> None:
    if cfg.layouts:
        return layouts_main(cfg)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for size in cfg.sizes:
            model_dir = save_model(size, root)
            for dtype in cfg.dtypes:
                ranks, took_mb = launch(cfg, model_dir, dtype)
                worst = {m: {k: max(r[m][k] for r in ranks) for k in ("s", "extra_mb")}
                         for m in ("hybrid", "hybrid/layer", "naive", "gather", "floor")}
                rows.append((size, dtype, ranks[0]["params"], worst, took_mb))
    print(f"\nWeight sync into vLLM, 2 ranks (gloo), fp32 masters, mean of {cfg.repeats} after a warm-up; the slower / "
          f"larger rank. Extra memory: peak RSS during the sync minus RSS before it.")
    for size, dtype, params, worst, took_mb in rows:
        model_mb = params * DTYPES[dtype].itemsize / MB
        hybrid = worst["hybrid"]
        print(f"\n{size}, rollout dtype {dtype}: {params / 1e6:.1f}M parameters, {model_mb:.0f} MB in {dtype}; "
              f"bucket {cfg.bucket_mb:.0f} MB; the 2 ranks took up to {took_mb / 1024:.1f} GB of the machine")
        print(f"{'method':<14} {'s/sync':>8} {'/ hybrid':>9} {'extra MB':>9} {'/ model':>8}")
        for method, m in worst.items():
            print(f"{method:<14} {m['s']:>8.3f} {m['s'] / hybrid['s']:>9.2f} {m['extra_mb']:>9.0f} "
                  f"{m['extra_mb'] / model_mb:>8.2f}")
        bound = min(cfg.bucket_mb, model_mb) + 0.1 * model_mb
        print(f"naive / hybrid = {worst['naive']['s'] / hybrid['s']:.2f} (target >= 3); hybrid / floor = "
              f"{hybrid['s'] / worst['floor']['s']:.2f} (target <= 1.5); hybrid extra {hybrid['extra_mb']:.0f} MB vs "
              f"bucket + 10% of the model = {bound:.0f} MB")


if __name__ == "__main__":
    cli = tyro.cli(BenchConfig)
    (layout_worker if cli.layout else worker)(cli) if cli.worker_out else main(cli)
