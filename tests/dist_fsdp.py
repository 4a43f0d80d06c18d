"""The torchrun worker of tests/test_sharding.py, and the training step that both it and the test's single
process reference run share (so the two compute the same thing by construction).

    OMP_NUM_THREADS=1 python -m pytest tests/test_sharding.py -q      # launches this file; the usual way
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 tests/dist_fsdp.py MODEL_DIR CKPT_FROM_1_RANK OUT_DIR   # by hand

MODEL_DIR holds the tiny Qwen2 and its tokenizer, CKPT_FROM_1_RANK a checkpoint that one process saved after
2 steps; each rank writes its results to OUT_DIR/rank{r}.pt, and rank 0 a 2-rank checkpoint to OUT_DIR/ckpt.
"""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: comm, sharding

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from comm import Max, Min, Sum, all_max, init_distributed, reduce_metrics, shutdown  # noqa: E402
from sharding import (FSDPConfig, clip_grad_norm, export_hf, full_weights, load_sharded,  # noqa: E402
                      load_sharded_model, save_sharded)

BATCH, SEQ = 4, 12
MAX_NORM = 1.0  # below the tiny model's first gradient norms, so clipping is exercised


def make_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch; labels mask a different prompt length per row, so ranks hold different token counts."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (BATCH, SEQ), generator=g)  # [B, T]
    labels = input_ids.clone()  # [B, T]
    for row in range(BATCH):
        labels[row, : 2 + 2 * row] = -100
    return input_ids, labels


def make_optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def train_step(model, optimizer, batch, dist) -> tuple[float, float]:
    """One AdamW step on this dp rank's rows of the batch; returns (global token-mean loss, grad norm)."""
    input_ids, labels = batch
    rows = slice(dist.dp_rank * BATCH // dist.dp_size, (dist.dp_rank + 1) * BATCH // dist.dp_size)
    n_tokens = (labels[:, 1:] != -100).sum()  # over the global batch: the loss is one token mean
    logits = model(input_ids=input_ids[rows]).logits  # [B/dp, T, V]
    loss_part = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[rows, 1:].flatten(), reduction="sum") / n_tokens
    (loss_part * dist.dp_size).backward()  # FSDP averages gradients over dp ranks: undo its 1/dp
    norm = clip_grad_norm(model, MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()
    return reduce_metrics({"loss": Sum(loss_part.item())}, dist)["loss"], norm


def full_params(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in full_weights(model, 1 << 40) for name, t in bucket}


def full_optim(model, optimizer) -> dict:
    """A copy of the optimizer state with full tensors, keyed by parameter name (filled on rank 0 only)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=options))  # plain: live references


def main(model_dir: str, ckpt_from_1: str, out_dir: str):
    dist = init_distributed(timeout_s=120)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(len(tokenizer))
    res = {}

    model = load_sharded_model(model_dir, dist, FSDPConfig(forward_prefetch=True))
    res["buffers"] = {name: b.clone() for name, b in model.named_buffers()}
    res["weights_1"] = [[(n, t.clone()) for n, t in bucket] for bucket in full_weights(model, 1)]
    res["weights_big"] = [[(n, t.clone()) for n, t in bucket] for bucket in full_weights(model, 10 << 30)]

    optimizer = make_optimizer(model)
    res["losses"], res["norms"] = [], []
    for step in (1, 2, 3):
        loss, norm = train_step(model, optimizer, batch, dist)
        res["losses"].append(loss)
        res["norms"].append(norm)
        if step == 2:
            save_sharded(os.path.join(out_dir, "ckpt"), model, optimizer, {"step": step, "rank": dist.rank}, dist)
            res["optim_2"] = full_optim(model, optimizer)
    res["params_3"] = full_params(model)

    for name, ckpt in (("2to2", os.path.join(out_dir, "ckpt")), ("1to2", ckpt_from_1)):
        model = load_sharded_model(model_dir, dist)
        optimizer = make_optimizer(model)
        res[f"{name}_extra"] = load_sharded(ckpt, model, optimizer, dist)
        res[f"{name}_optim"] = full_optim(model, optimizer)
        res[f"{name}_loss"] = train_step(model, optimizer, batch, dist)[0]
        res[f"{name}_params"] = full_params(model)

    export_hf(model, tokenizer, os.path.join(out_dir, "hf"), dist)

    # bf16 compute with fp32 reduce, offloaded shards: masters stay fp32
    model = load_sharded_model(model_dir, dist, FSDPConfig(param_dtype="bfloat16", cpu_offload=True))
    res["bf16_loss"] = train_step(model, make_optimizer(model), batch, dist)[0]
    res["bf16_master_dtypes"] = {p.dtype for p in model.parameters()}

    res["metrics"] = reduce_metrics({"a": dist.rank + 1.0, "x/max": Max(dist.rank), "x/min": Min(dist.rank),
                                     "y_max": dist.rank, "tokens": Sum(5 + dist.rank)}, dist)
    res["widths"] = all_max([dist.rank, 7 - dist.rank], dist)
    torch.save(res, os.path.join(out_dir, f"rank{dist.rank}.pt"))
    shutdown(dist)


if __name__ == "__main__":
    main(*sys.argv[1:4])
