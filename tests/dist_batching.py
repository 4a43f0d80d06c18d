"""The torchrun worker of tests/test_batching.py's 2-rank test, and the batch that both it and the test's
single-process reference use.

    OMP_NUM_THREADS=1 python -m pytest tests/test_batching.py -q -k two_ranks      # launches this file
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 tests/dist_batching.py MODEL_DIR OUT_DIR     # by hand

Rank 0 holds the long sequences of the global batch and rank 1 the short ones. Each rank writes OUT_DIR/rank{r}.pt:
its rows after balancing, the micro-batch counts, and the full gradients of one update with dynamic packed
micro-batches and with the fixed split (also in the token-sum and seq-mean-token-mean modes, and with gradient
checkpointing), and how many gradient reduce-scatters each update made.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

from batching import split_by_tokens  # noqa: E402
from batching import balance_ranks, flops_workload  # noqa: E402
from comm import init_distributed, shutdown  # noqa: E402
from config import BUILTIN_TASK, Config  # noqa: E402
from sharding import decoder_layers  # noqa: E402
from workers import ActorWorker, pad_batch  # noqa: E402

N_SAMPLES, N_PROMPTS = 2, 4
BUDGET = 24  # tokens: rank 0's sequences (27-39 tokens) run one by one, rank 1's (6-11) pack two or three at a time


def config(model_path: str, **overrides) -> Config:
    """Both loss terms on (KL, entropy), no clipping of the gradient (it is what the tests compare)."""
    return Config(**{**BUILTIN_TASK, **dict(
        model_path=model_path, rollout_backend="hf", rollout_n=N_SAMPLES, train_batch_size=N_PROMPTS,
        ppo_mini_batch_size=N_PROMPTS, use_kl_loss=True, entropy_coeff=0.01, grad_clip=1e9, max_response_length=32),
        **overrides})


def global_batch(vocab_size: int, pad_id: int):
    """8 rows (4 prompts x 2 samples): the first 4 long, the last 4 short; fixed old/ref log-probs, advantages."""
    g = torch.Generator().manual_seed(0)
    prompt_lens, response_lens = [5, 7, 3, 4], [[25, 32], [20, 30], [4, 8], [3, 5]]
    prompts = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for group in response_lens for n in group]
    repeated = [p for p in prompts for _ in range(N_SAMPLES)]
    batch = with_rl_fields(pad_batch(repeated, responses, [[0.0] * len(r) for r in responses], pad_id), g)
    batch["row"] = torch.arange(len(responses))  # [B]: which global row, to follow rows through balancing
    return batch


def with_rl_fields(batch, g: torch.Generator):
    """Fixed old and reference log-probs and per-sequence advantages: the update's inputs, independent of a model."""
    mask = batch["response_mask"]  # [B, R]
    batch["old_log_probs"] = -torch.rand(mask.shape, generator=g) * 3 * mask  # [B, R]
    batch["ref_log_probs"] = -torch.rand(mask.shape, generator=g) * 3 * mask  # [B, R]
    batch["advantages"] = torch.randn(mask.shape[0], 1, generator=g) * mask  # [B, R]
    return batch


def capture_gradients(worker: ActorWorker) -> list[dict]:
    """Make worker.opt.step record the full gradients (instead of stepping); returns the list it fills."""
    grads = []

    def record():
        grads.append({name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                      for name, p in worker.model.named_parameters()})

    worker.opt.step = record
    return grads


# the updates each rank runs: name -> Config overrides (the test compares each with one process on the whole batch)
UPDATES = {"dynamic": dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET, use_remove_padding=True),
           "fixed": dict(ppo_micro_batch_size=2),
           "token-sum": dict(ppo_micro_batch_size=2, loss_agg_mode="token-sum"),
           "seq-mean-token-mean": dict(ppo_micro_batch_size=2, loss_agg_mode="seq-mean-token-mean"),
           "checkpointed": dict(ppo_micro_batch_size=2, gradient_checkpointing=True)}


def counting_reduce_scatters() -> list:
    """Count FSDP2's gradient reduce-scatters (torch.distributed.reduce_scatter_single, which it calls by name)."""
    calls, real = [], tdist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls.append(None)
        return real(*args, **kwargs)

    tdist.reduce_scatter_single = counted
    return calls


def main(model_dir: str, out_dir: str):
    dist = init_distributed(timeout_s=120)
    res, reduce_scatters = {}, counting_reduce_scatters()
    for name, overrides in UPDATES.items():
        worker = ActorWorker(config(model_dir, **overrides), model_dir, dist)
        batch = global_batch(worker.model.config.vocab_size, worker.tokenizer.pad_token_id)
        rows = batch.batch_size[0] // dist.dp_size
        mine = batch[dist.dp_rank * rows : (dist.dp_rank + 1) * rows]
        res[f"{name}_log_probs"] = worker.log_probs(mine)
        grads = capture_gradients(worker)
        reduce_scatters.clear()
        res[f"{name}_metrics"] = worker.update(mine)
        res[f"{name}_reduce_scatters"] = len(reduce_scatters)  # one mini-batch: once per FSDP2 group, not per micro
        res["fsdp_groups"] = len(decoder_layers(worker.model)) + 1  # each decoder layer, and the root
        res[f"{name}_grads"] = grads[0]
        if name == "dynamic":
            res["own_count"] = len(split_by_tokens(mine["attention_mask"].sum(-1).tolist(), BUDGET))
            seqlens = mine["attention_mask"].sum(-1)  # [b]
            balanced, res["balance_metrics"] = balance_ranks(mine, seqlens, seqlens, dist, unit=N_SAMPLES)
            res["balanced_rows"] = balanced["row"]
            # every key travels with its row (all-to-all per dtype), the rows in their global order
            res["balanced_intact"] = all(balanced[k].equal(batch[balanced["row"]][k]) for k in batch.keys())
            res["balanced_tokens"] = balanced["attention_mask"].sum().item()
            hidden = worker.model.config.hidden_size
            flops = flops_workload(seqlens, hidden)  # [b], balance_by flops
            balanced = balance_ranks(mine, seqlens, flops, dist, unit=N_SAMPLES)[0]
            res["flops_rows"] = balanced["row"]
            res["flops_before"] = flops.sum().item()
            res["flops_after"] = flops_workload(balanced["attention_mask"].sum(-1), hidden).sum().item()
    torch.save(res, os.path.join(out_dir, f"rank{dist.rank}.pt"))
    shutdown(dist)


if __name__ == "__main__":
    main(*sys.argv[1:3])
