"""Dynamic batching: padding and actor-update time, fixed padded micro-batches vs token-budget packed ones, one run.

    OMP_NUM_THREADS=1 python bench/batching.py                      # ~11M-parameter Qwen2, 64 sequences
    OMP_NUM_THREADS=1 python bench/batching.py --hidden-size 128 --num-layers 2 --batch-size 32 --steps 1   # quick

One batch with skewed response lengths (lognormal, as RL rollouts are: most short, a few near the limit), one
randomly initialised Qwen2 saved once, two ActorWorkers on it (workers.py, one process, fp32 AdamW):
- fixed: ppo_micro_batch_size sequences per micro-batch, every row padded to the batch's longest sequence;
- dynamic: use_dynamic_bsz with ppo_max_token_len_per_gpu, use_remove_padding (one packed row per micro-batch).
Both take one whole-batch optimizer step per update (ppo_mini_batch_size = the batch). The first update of each
is untimed and records the gradient instead of stepping, so the two gradients are compared; then `steps` timed
updates and old-log-prob passes. Padding: the share of the token positions a forward computes that are padding.
"""

import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, not bench/

import torch  # noqa: E402
import tyro  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from comm import init_distributed  # noqa: E402
from config import Config  # noqa: E402
from workers import ActorWorker, pad_batch  # noqa: E402
from tiny import build_byte_tokenizer  # noqa: E402


@dataclass
class BenchConfig:
    hidden_size: int = 256
    """Model width (head size 64)."""
    num_layers: int = 4
    """Decoder layers."""
    intermediate_size: int = 704
    """MLP width."""
    vocab_size: int = 32000
    """Vocabulary (tied input/output embeddings)."""
    batch_size: int = 64
    """Sequences in the batch (one optimizer step)."""
    max_prompt_length: int = 64
    """Prompt lengths are uniform in [max_prompt_length / 4, max_prompt_length]."""
    max_response_length: int = 512
    """Response lengths: lognormal, clipped to this."""
    median_response_length: int = 48
    """Median of the lognormal response lengths (sigma 1: the mean is ~1.65x the median)."""
    micro_batch_size: int = 8
    """fixed: sequences per micro-batch."""
    max_token_len: int = 2048
    """dynamic: tokens per micro-batch (ppo_max_token_len_per_gpu; also the log-prob budget)."""
    steps: int = 2
    """Timed updates (and log-prob passes) per setting, after the untimed one."""
    seed: int = 0
    """Lengths, tokens and initialisation."""


def make_batch(cfg: BenchConfig, pad_id: int):
    g = torch.Generator().manual_seed(cfg.seed)
    prompt_lens = torch.randint(cfg.max_prompt_length // 4, cfg.max_prompt_length + 1, (cfg.batch_size,), generator=g)
    response_lens = (torch.empty(cfg.batch_size).log_normal_(math.log(cfg.median_response_length), 1.0, generator=g)
                     .long().clamp(1, cfg.max_response_length))  # [B]
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist() for n in response_lens]
    batch = pad_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_id)
    mask = batch["response_mask"]
    batch["old_log_probs"] = (-torch.rand(mask.shape, generator=g) - math.log(cfg.vocab_size)) * mask  # [B, R]
    batch["advantages"] = torch.randn(cfg.batch_size, 1, generator=g) * mask  # [B, R]
    return batch


def measure(cfg: BenchConfig, model_dir: str, batch, **overrides) -> dict:
    """One setting: the first update's gradient, then mean update and log-prob times, padding share, micro-batches."""
    worker = ActorWorker(Config(model_path=model_dir, rollout_backend="hf", rollout_n=1, train_batch_size=cfg.batch_size,
                                ppo_mini_batch_size=cfg.batch_size, max_response_length=cfg.max_response_length,
                                seed=cfg.seed, **overrides), model_dir, init_distributed())
    grads, step = [], worker.opt.step
    worker.opt.step = lambda: grads.append([p.grad.clone() for p in worker.model.parameters()])
    metrics = worker.update(batch)  # untimed: warms up, records the gradient
    worker.opt.step = step
    update_s, log_prob_s = [], []
    for _ in range(cfg.steps):
        start = time.perf_counter()
        worker.update(batch)
        update_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        worker.log_probs(batch)
        log_prob_s.append(time.perf_counter() - start)
    real = batch["attention_mask"].sum().item()
    computed = real if worker.remove_padding else batch["attention_mask"].numel()  # fixed micro-batches keep the width
    return {"grads": grads[0], "update_s": sum(update_s) / cfg.steps, "log_prob_s": sum(log_prob_s) / cfg.steps,
            "padding": 1 - real / computed, "micro_batches": metrics["actor/num_micro_batches"]}


def main(cfg: BenchConfig) -> None:
    torch.manual_seed(cfg.seed)
    tokenizer = build_byte_tokenizer()  # ActorWorker loads one; the token ids here are random anyway
    config = Qwen2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.hidden_size // 64,
                         num_key_value_heads=max(1, cfg.hidden_size // 256), tie_word_embeddings=True,
                         max_position_embeddings=cfg.max_prompt_length + cfg.max_response_length)
    batch = make_batch(cfg, tokenizer.pad_token_id)
    with tempfile.TemporaryDirectory() as tmp:
        model = Qwen2ForCausalLM(config)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        fixed = measure(cfg, tmp, batch, ppo_micro_batch_size=cfg.micro_batch_size)
        dynamic = measure(cfg, tmp, batch, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=cfg.max_token_len,
                          use_remove_padding=True)
    lengths = batch["attention_mask"].sum(-1).float()
    grad_diff = max((a - b).abs().max().item() for a, b in zip(fixed["grads"], dynamic["grads"]))
    grad_max = max(a.abs().max().item() for a in fixed["grads"])
    print(f"\n{n_params / 1e6:.1f}M-parameter Qwen2 (hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab "
          f"{cfg.vocab_size}), fp32, {cfg.batch_size} sequences of {lengths.min():.0f}-{lengths.max():.0f} tokens "
          f"(mean {lengths.mean():.0f}, padded width {batch['attention_mask'].shape[1]}), mean of {cfg.steps} steps")
    print(f"{'':<28} {'fixed, padded':>14} {'dynamic, packed':>16} {'fixed / dynamic':>16}")
    print(f"{'micro-batches per update':<28} {fixed['micro_batches']:>14.0f} {dynamic['micro_batches']:>16.0f}")
    print(f"{'padding share of tokens':<28} {fixed['padding']:>14.3f} {dynamic['padding']:>16.3f}")
    for key, label in (("update_s", "actor update (s)"), ("log_prob_s", "old log-prob pass (s)")):
        print(f"{label:<28} {fixed[key]:>14.2f} {dynamic[key]:>16.2f} {fixed[key] / dynamic[key]:>15.2f}x")
    print(f"same gradient: max |difference| {grad_diff:.2e} (largest gradient entry {grad_max:.2e})")


if __name__ == "__main__":
    main(tyro.cli(BenchConfig))
