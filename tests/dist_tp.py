"""The torchrun worker of tests/test_tp.py: training tensor parallelism on 4 ranks, dp 2 x tp 2 (gloo), and the
zero-redundancy weight sync into vLLM engines sharded like the trainer (rollout_tp 2).

    OMP_NUM_THREADS=1 python -m pytest tests/test_tp.py -q        # launches this file; the usual way
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 tests/dist_tp.py MODEL_DIR RM_DIR OUT_DIR   # by hand

On the fixed batch of tests/dist_batching.py (each dp rank its half): the actor's log-probs, one update's full
gradients (PPO's and GRPO's loss terms: clipped surrogate, KL, entropy; also with token-budget packed micro-batches
and gradient checkpointing), the weights after one AdamW step, the critic's values, a reward model's scores
(RewardWorker: the same plan, frozen); a checkpoint of the updated actor, which a dp 4 x tp 1 actor then loads (its
full weights and AdamW state); and a verified sync of the slice path into the TP-2 engines (checksums of the blocks,
the probe), then one of the full path (hybrid.layout full), with the bytes each rank handed over. Each rank writes
OUT_DIR/rank{r}.pt.
"""

import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
from dist_batching import capture_gradients, config, global_batch  # noqa: E402
from dist_fsdp import full_optim  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from comm import Dist, init_distributed, shutdown, tp_layout  # noqa: E402
from hybrid_engine import HybridConfig, HybridEngine  # noqa: E402
from sharding import FSDPConfig, full_weights  # noqa: E402
from workers import ActorWorker, CriticWorker, RewardWorker  # noqa: E402

TP = 2
PROMPTS = [[[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14]]]  # each dp rank's two prompts


def tp_config(model_dir: str, tp: int = TP, **overrides):
    """dist_batching's config (KL and entropy terms, no gradient clipping), with training TP."""
    return config(model_dir, fsdp=FSDPConfig(tp_size=tp), ppo_micro_batch_size=2, lr=1e-3, **overrides)


def stepping_worker(model_dir: str, dist, tp: int = TP) -> ActorWorker:
    """An actor whose AdamW step is compared across layouts: eps 1e-4, as Adam's first step moves a weight by
    lr * g / (|g| + eps), which for a gradient near 0 (1e-8) turns TP's reordered sums (1e-11) into 1e-5 of weight."""
    worker = ActorWorker(tp_config(model_dir, tp=tp), model_dir, dist)
    for group in worker.opt.param_groups:
        group["eps"] = 1e-4
    return worker


def main(model_dir: str, reward_dir: str, out_dir: str):
    dist = init_distributed(timeout_s=300, tp=TP, rollout_tp=TP)
    res = {"dp": dist.dp_size, "tp": dist.tp_size, "dp_rank": dist.dp_rank, "tp_rank": dist.tp_rank}
    batch = global_batch(AutoConfig.from_pretrained(model_dir).vocab_size, 0)  # the byte tokenizer's pad id: 0
    rows = batch.batch_size[0] // dist.dp_size
    mine = batch[dist.dp_rank * rows : (dist.dp_rank + 1) * rows]

    actor = ActorWorker(tp_config(model_dir), model_dir, dist)
    res["layer_placements"] = {n: str(p.placements) for n, p in actor.model.named_parameters() if "layers.0." in n}
    res["log_probs"] = actor.log_probs(mine)
    grads = capture_gradients(actor)
    res["metrics"] = actor.update(mine)
    res["grads"] = grads[0]

    packed = ActorWorker(tp_config(model_dir, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=24,
                                   use_remove_padding=True, gradient_checkpointing=True), model_dir, dist)
    grads = capture_gradients(packed)  # token-budget packed micro-batches (position ids per sequence), recomputed
    packed.update(mine)
    res["packed_grads"] = grads[0]

    stepping = stepping_worker(model_dir, dist)  # one real AdamW step, then its checkpoint
    stepping.update(mine)
    res["params"] = {n: t.clone() for bucket in full_weights(stepping.model, 1 << 40) for n, t in bucket}
    stepping.save_checkpoint(os.path.join(out_dir, "ckpt"))
    res["optim"] = full_optim(stepping.model, stepping.opt)

    # the same checkpoint at another layout: dp 4 x tp 1 on these ranks
    mesh = DeviceMesh(dist.device.type, tp_layout(dist.world_size, 1), mesh_dim_names=("dp", "tp"))
    flat = Dist(dist.rank, dist.world_size, dist.local_rank, dist.device, mesh, dist.is_main)
    resumed = ActorWorker(tp_config(model_dir, tp=1), model_dir, flat)
    resumed.load_checkpoint(os.path.join(out_dir, "ckpt"))
    res["resumed_params"] = {n: t.clone() for bucket in full_weights(resumed.model, 1 << 40) for n, t in bucket}
    res["resumed_optim"] = full_optim(resumed.model, resumed.opt)

    critic = CriticWorker(tp_config(model_dir, adv_estimator="gae"), model_dir, dist)
    res["values"] = critic.values(mine)
    res["rm_scores"] = RewardWorker(tp_config(model_dir, reward_model_path=reward_dir), dist).scores(mine)  # [rows]

    # the slice sync into TP-2 vLLM engines (ranks 0-1 and 2-3), every sync verified
    engine = ActorWorker(tp_config(model_dir, rollout_backend="vllm", rollout_tp=TP,
                                   hybrid=HybridConfig(verify_sync=True)), model_dir, dist)
    engine.update(mine)  # weights the engines do not have yet
    out, metrics = engine.generate(PROMPTS[dist.dp_rank], seeds=[0, 1])
    res["sync"] = {k: v for k, v in metrics.items() if k.startswith("reshard/")}
    res["responses"] = out["responses"]
    # the reference path into the same engines: every weight whole on every rank (vLLM cuts its own blocks)
    engine.hybrid = HybridEngine(engine.model, engine.rollout, dist, replace(engine.cfg.hybrid, layout="full"),
                                 torch.float32)
    res["full_sync"] = {k: v for k, v in engine.generate(PROMPTS[dist.dp_rank], seeds=[0, 1])[1].items()
                        if k.startswith("reshard/")}
    torch.save(res, os.path.join(out_dir, f"rank{dist.rank}.pt"))
    engine.close()
    shutdown(dist)


if __name__ == "__main__":
    main(*sys.argv[1:4])
