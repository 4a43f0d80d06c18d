"""The torchrun worker of tests/test_hybrid_engine.py: the hybrid engine on 2 ranks (gloo), one vLLM engine per
rank and model, fp32 (and once bf16).

    OMP_NUM_THREADS=1 python -m pytest tests/test_hybrid_engine.py -q      # launches this file; the usual way
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 tests/dist_hybrid.py TIED_DIR UNTIED_DIR OUT_DIR   # by hand

For each model (tied and untied embeddings): AdamW steps, each followed by a verified sync (verify_sync raises on
any mismatch). On the tied model also: the buckets that 1-byte and 10 GB buckets hand to the engine, and two
deliberate corruptions on one rank, one before the hand-over (checksums must name it) and one after it (the probe
must catch it); both ranks must raise. Then the tied model once more in bf16, as ppo.py runs with
--fsdp.param-dtype bfloat16 (fp32 masters, bf16 compute, engine and stream). Each rank writes what it saw to
OUT_DIR/rank{r}.pt.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
from dist_fsdp import make_batch, make_optimizer, train_step  # noqa: E402

import hybrid_engine  # noqa: E402
from comm import barrier, init_distributed, shutdown  # noqa: E402
from hybrid_engine import MB, HybridConfig, HybridEngine  # noqa: E402
from rollout import VLLMRollout  # noqa: E402
from sharding import DTYPES, FSDPConfig, load_sharded_model  # noqa: E402

STEPS = 3
CORRUPT = "model.layers.1.mlp.up_proj.weight"
BF16_TOL = 0.02  # probe gap allowed in bf16 (measured up to 0.004): two bf16 implementations round differently


def sync(hybrid: HybridEngine) -> dict:
    metrics = {}
    with hybrid.rollout_mode(metrics):
        pass
    return metrics


def sync_error(hybrid: HybridEngine) -> str:
    try:
        sync(hybrid)
    except RuntimeError as e:
        return str(e)
    return ""


def recording(rollout: VLLMRollout) -> list:
    """Make rollout.update_weights keep a copy of every bucket it is handed; returns the (growing) list."""
    buckets, update = [], rollout.update_weights

    def update_and_record(weights):
        bucket = [(name, tensor.clone()) for name, tensor in weights]
        buckets.append(bucket)
        update(bucket)

    rollout.update_weights = update_and_record
    return buckets


def one_element_off(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[0] += 1e-3
    return tensor


def train_and_sync(model_dir: str, dist, res: dict, dtype: str = "float32") -> tuple:
    model = load_sharded_model(model_dir, dist, FSDPConfig(param_dtype=dtype))
    optimizer = make_optimizer(model)
    rollout = VLLMRollout(model_dir, max_model_len=64, dtype=dtype, in_group=True)
    cfg = HybridConfig(verify_sync=True, verify_tol=BF16_TOL if dtype == "bfloat16" else 1e-4)
    hybrid = HybridEngine(model, rollout, dist, cfg, DTYPES[dtype])
    res["probe_before"] = rollout.prompt_log_probs(hybrid.probe.tolist())  # the saved weights
    batch = make_batch(model.config.vocab_size)
    res["syncs"] = []
    for _ in range(STEPS):
        train_step(model, optimizer, batch, dist)
        res["syncs"].append(sync(hybrid))
    res["probe_after"] = rollout.prompt_log_probs(hybrid.probe.tolist())
    return model, optimizer, rollout


def main(tied_dir: str, untied_dir: str, out_dir: str):
    dist = init_distributed(timeout_s=300)
    res = {"tied": {}, "untied": {}, "bf16": {}}
    model, optimizer, rollout = train_and_sync(tied_dir, dist, res["tied"])
    buckets = recording(rollout)
    for size in (1, 10 << 30):  # bytes
        hybrid = HybridEngine(model, rollout, dist, HybridConfig(bucket_mb=size / MB, verify_sync=True),
                              torch.float32)
        del buckets[:]
        res["tied"][size] = {"metrics": sync(hybrid), "buckets": [list(b) for b in buckets]}

    # Corrupted before the hand-over, on rank 1 only: its checksums must name the parameter, and rank 0 raise too.
    clean = hybrid_engine.full_weights
    if dist.rank == 1:
        hybrid_engine.full_weights = lambda *args: ([(n, one_element_off(t) if n == CORRUPT else t) for n, t in b]
                                                    for b in clean(*args))
    res["checksum_error"] = sync_error(hybrid)
    hybrid_engine.full_weights = clean
    # Corrupted inside rank 0's engine update (after the checksums): only the probe can see it.
    update = rollout.update_weights
    if dist.rank == 0:
        rollout.update_weights = lambda weights: update((n, t * 1.5 if n == CORRUPT else t) for n, t in weights)
    res["probe_error"] = sync_error(hybrid)
    rollout.update_weights = update
    res["clean_again"] = sync(hybrid)  # a clean sync repairs the engine

    untied = train_and_sync(untied_dir, dist, res["untied"])[2]
    bf16 = train_and_sync(tied_dir, dist, res["bf16"], "bfloat16")[2]
    torch.save(res, os.path.join(out_dir, f"rank{dist.rank}.pt"))
    barrier(dist)  # the last collective: closing an engine destroys the default process group
    for engine in (rollout, untied, bf16):
        engine.close()
    shutdown(dist)


if __name__ == "__main__":
    main(*sys.argv[1:4])
