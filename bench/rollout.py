"""Rollout throughput: the vLLM engine vs HF generate, same model, same prompts, same sampling, one run.

    python bench/rollout.py
    OMP_NUM_THREADS=1 python bench/rollout.py                         # on a machine shared with other jobs
    python bench/rollout.py --num-prompts 16 --n 2 --max-tokens 16     # a quick look

The model is the built-in tiny policy at SFTConfig's default sizes, randomly initialised: its next-token
distribution is near uniform, so a few responses stop early on EOS (~1/V per token). Each backend is
timed on its own tokens (the response lengths it returned), after one untimed warm-up call.
Both run in this process with the same torch threads. When another job keeps a core busy, OpenMP threads
spin-wait on each other and every small op slows down several-fold (measured 6x on 2 cores, both backends):
OMP_NUM_THREADS=1 gives the numbers of a quiet machine.
"""

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's rollout.py, not this file

import torch  # noqa: E402
import tyro  # noqa: E402
from data import tokenize_prompt  # noqa: E402
from data.arith import ArithConfig, make_problems  # noqa: E402
from rollout import HFRollout, VLLMRollout  # noqa: E402
from sft import SFTConfig  # noqa: E402
from tiny import build_byte_tokenizer, build_tiny_qwen2  # noqa: E402


@dataclass
class BenchConfig:
    num_prompts: int = 64
    """Prompts per generate call (built-in arithmetic questions, chat-formatted)."""
    n: int = 4
    """Samples per prompt."""
    max_tokens: int = 32
    """New tokens per sample (fewer where a sample stops on EOS)."""
    temperature: float = 1.0
    """Sampling temperature."""
    repeats: int = 3
    """Timed calls per backend; the table reports their mean."""
    dtype: str = "float32"
    """Model dtype of both backends."""
    seed: int = 0
    """Model initialisation and sampling seed."""


def timed(rollout, prompts: list[list[int]], cfg: BenchConfig) -> tuple[int, float]:
    """Mean tokens and seconds per generate call, after one warm-up call."""
    kwargs = dict(n=cfg.n, max_tokens=cfg.max_tokens, temperature=cfg.temperature)
    rollout.generate(prompts[:4], seeds=list(range(4)), **kwargs)
    tokens, seconds = 0, 0.0
    for r in range(cfg.repeats):
        seeds = [cfg.seed + 1000 * r + i for i in range(len(prompts))]
        start = time.perf_counter()
        out = rollout.generate(prompts, seeds=seeds, **kwargs)
        seconds += time.perf_counter() - start
        tokens += sum(len(x) for x in out.responses)
    return tokens // cfg.repeats, seconds / cfg.repeats


def main(cfg: BenchConfig):
    tok = build_byte_tokenizer()
    model = build_tiny_qwen2(tok, SFTConfig(seed=cfg.seed)).to(getattr(torch, cfg.dtype))
    problems = make_problems(ArithConfig(), cfg.num_prompts, seed=cfg.seed)
    prompts = [tokenize_prompt(tok, [{"role": "user", "content": p["expression"]}]) for p in problems]
    n_params = sum(p.numel() for p in model.parameters())

    rows = []
    threads = torch.get_num_threads()
    rows.append(("HF generate", threads, *timed(HFRollout(model, tok, torch.device("cpu")), prompts, cfg)))
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        tok.save_pretrained(path)
        max_len = max(map(len, prompts)) + cfg.max_tokens
        engine = VLLMRollout(path, max_model_len=max_len, seed=cfg.seed, dtype=cfg.dtype)
        rows.append(("vLLM", torch.get_num_threads(), *timed(engine, prompts, cfg)))

    print(f"\n{n_params / 1e6:.1f}M-parameter Qwen2, {cfg.dtype}, {cfg.num_prompts} prompts x n={cfg.n} x "
          f"{cfg.max_tokens} new tokens, temperature {cfg.temperature}, mean of {cfg.repeats} calls")
    print(f"{'backend':<12} {'threads':>7} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    for name, thr, tokens, seconds in rows:
        print(f"{name:<12} {thr:>7} {tokens:>7} {seconds:>8.2f} {tokens / seconds:>9.0f}")
    (_, _, hf_tok, hf_s), (_, _, vl_tok, vl_s) = rows
    print(f"vLLM / HF tokens/s: {(vl_tok / vl_s) / (hf_tok / hf_s):.1f}x")


if __name__ == "__main__":
    main(tyro.cli(BenchConfig))
