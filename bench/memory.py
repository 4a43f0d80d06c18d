"""Peak memory of the log-prob pass and of the update at Qwen2.5-0.5B's shapes, against a floor computed from the
shapes, for the way log-probs were computed before and each change since, side by side in one run.

    python bench/memory.py                                          # CPU: peak RSS (~25 min on 2 cores)
    python bench/memory.py --phases log_probs --response-tokens 4096   # the issue's check alone (~5 min on CPU)
    python bench/memory.py --size tiny                              # a quick look at the table

The model is made here (random init, fp32, no download; bench/gpu_smoke.py's SHAPES). A micro-batch is `rows`
sequences of 256 prompt tokens and `response_tokens` response tokens (rows: as many as fit 16,384 tokens, the
log-prob passes' default budget; the update takes `update_rows`). Each variant runs in a process of its own, and its
peak is the process's: on GPU torch.cuda.max_memory_allocated, on CPU the peak RSS (VmHWM), reset after the model is
built and, for the update, after AdamW's state exists (a zero-lr step), so both count what the phase adds to what a
run holds anyway. The variants:
  full     before issue 22: logits at every position [b, T, V], .float() / temperature, log_softmax, gather; the
           entropy from the whole softmax, with grad (workers.py at 9b45924)
  sliced   logits only at the positions that predict response tokens (the head on [b, R, H]), then as `full`
  chunked  nanoverl's: workers.response_log_probs (hidden states sliced before the head, log-probs and entropy a
           chunk of rows at a time, checkpointed under autograd; the entropy without grad: entropy_coeff 0)
  chunked+gc  chunked, and gradient checkpointing of the decoder layers (the update only)
The model computes as a one-process run does (fp32 weights, autocast to --dtype: bf16 on GPU, fp32 on CPU). The
floor: log-prob pass = the weights + one [tokens, hidden] hidden state in the compute dtype; update = weights,
gradients and AdamW's two moments (4 x the weights in fp32) + the residual stream that gradient checkpointing keeps
(one [tokens, hidden] per layer). On CPU the process's RSS before the model existed (torch and transformers loaded) is
added to both: it is the runtime's, not the shapes'. Printed: GB and the ratio to the floor.
"""

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's modules, not bench/

import torch  # noqa: E402
import tyro  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from gpu_smoke import SHAPES  # noqa: E402
from perf import peak_memory, proc_status, reset_peak_memory  # noqa: E402
from sharding import DTYPES, compute_in  # noqa: E402
from workers import pad_batch, response_log_probs  # noqa: E402

PROMPT_TOKENS = 256
VARIANTS = ("full", "sliced", "chunked", "chunked+gc")


@dataclass
class MemoryConfig:
    size: Literal["qwen2.5-0.5b", "tiny"] = "qwen2.5-0.5b"
    """Model shapes (bench/gpu_smoke.py's SHAPES)."""
    response_tokens: tuple[int, ...] = (1024, 4096)
    """Response lengths to measure."""
    phases: tuple[Literal["log_probs", "update"], ...] = ("log_probs", "update")
    """Which phases."""
    update_rows: int = 1
    """Sequences in the update's micro-batch (CPU: one 4k-token update of a 0.5B model takes ~1.5 min)."""
    dtype: Literal["float32", "bfloat16"] | None = None
    """The compute dtype (fp32 masters, autocast as a one-process run does); None: bfloat16 on GPU, float32 on CPU."""
    variant: str | None = None
    """Internal: measure this variant in this process (phase, response_tokens from the lists' first entries)."""


def head_logits_log_probs(model, batch, temperature: float, sliced: bool):
    """Before issue 22 (full) and its first step (sliced): whole logits, log_softmax, gather, entropy with grad."""
    R = batch["responses"].shape[1]
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"], use_cache=False)
    logits = model(**kwargs, logits_to_keep=R + 1).logits[:, :-1] if sliced else model(**kwargs).logits[:, -R - 1:-1]
    logits = logits.float() / temperature  # [b, R, V]
    logp = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)  # [b, R]
    probs = logits.softmax(-1)
    entropy = torch.logsumexp(logits, -1) - (probs * logits).sum(-1)  # [b, R], with grad
    return logp, entropy


def measure(cfg: MemoryConfig) -> dict:
    """One variant, one phase, one length, in this process: its peak and its floor (bytes)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runtime = 0 if device.type == "cuda" else proc_status("VmRSS")
    phase, R, variant = cfg.phases[0], cfg.response_tokens[0], cfg.variant
    shapes = SHAPES[cfg.size]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shapes, tie_word_embeddings=True)).to(device)
    dtype = DTYPES[cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    compute_in(model, dtype)  # as sharding.load_sharded_model does in one process
    if variant == "chunked+gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows = cfg.update_rows if phase == "update" else max(1, 16384 // (PROMPT_TOKENS + R))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shapes["vocab_size"], (rows, PROMPT_TOKENS + R), generator=g).tolist()
    batch = pad_batch([s[:PROMPT_TOKENS] for s in ids], [s[PROMPT_TOKENS:] for s in ids],
                      [[0.0] * R] * rows, 0).to(device)
    params = sum(p.numel() for p in model.parameters())
    tokens, hidden, layers = rows * (PROMPT_TOKENS + R), shapes["hidden_size"], shapes["num_hidden_layers"]
    if phase == "update":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # AdamW's moments exist, as in a run after its first step
        opt.zero_grad(set_to_none=True)
        floor = 4 * 4 * params + layers * tokens * hidden * dtype.itemsize
    else:
        model.eval()
        floor = 4 * params + tokens * hidden * dtype.itemsize
    reset_peak_memory(device)
    began = time.perf_counter()
    with torch.set_grad_enabled(phase == "update"):
        if variant in ("full", "sliced"):
            logp, entropy = head_logits_log_probs(model, batch, 0.7, sliced=variant == "sliced")
        else:
            logp, entropy = response_log_probs(model, batch, 0.7, with_entropy=True, entropy_grad=False)
        if phase == "update":
            (-(logp * batch["response_mask"]).sum() / batch["response_mask"].sum()).backward()
            opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    return dict(peak=peak_memory(device), floor=floor + runtime, seconds=time.perf_counter() - began, tokens=tokens,
                device=f"{device.type}, {str(dtype)[6:]}")


def main(cfg: MemoryConfig) -> None:
    rows = []
    for phase in cfg.phases:
        for R in cfg.response_tokens:
            for variant in VARIANTS if phase == "update" else VARIANTS[:3]:
                cmd = [sys.executable, str(Path(__file__).resolve()), f"--size={cfg.size}", f"--phases={phase}",
                       f"--response-tokens={R}", f"--update-rows={cfg.update_rows}", f"--variant={variant}"]
                cmd += [f"--dtype={cfg.dtype}"] if cfg.dtype else []
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if proc.returncode:  # SIGKILL: the kernel's OOM killer (the variant needs more than the machine has)
                    why = "killed (out of memory)" if proc.returncode == -9 else f"failed\n{proc.stderr[-2000:]}"
                    rows.append((phase, R, variant, why.split("\n")[0]))
                    print(f"{phase} R={R} {variant}: {why}", flush=True)
                    continue
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append((phase, R, variant, result))
                print(f"{phase:9} R={R:5d} {variant:11} peak {result['peak'] / 2**30:6.2f} GB, floor "
                      f"{result['floor'] / 2**30:6.2f} GB: {result['peak'] / result['floor']:.2f}x "
                      f"({result['tokens']} tokens, {result['seconds']:.1f} s, {result['device']})", flush=True)
    print("\n| phase | response tokens | tokens | " + " | ".join(VARIANTS) + " | floor |")
    print("|---|---|---|" + "---|" * (len(VARIANTS) + 1))
    for phase in cfg.phases:
        for R in cfg.response_tokens:
            got = {v: r for p, n, v, r in rows if p == phase and n == R}
            some = next((r for r in got.values() if isinstance(r, dict)), None)
            if some is None:
                continue
            cells = [f"{r['peak'] / 2**30:.2f} GB ({r['peak'] / r['floor']:.2f}x)" if isinstance(r, dict) else
                     r or "-" for r in (got.get(v) for v in VARIANTS)]
            print(f"| {phase} | {R} | {some['tokens']} | " + " | ".join(cells) + f" | {some['floor'] / 2**30:.2f} GB |")


if __name__ == "__main__":
    config = tyro.cli(MemoryConfig)
    if config.variant:
        print(json.dumps(measure(config)))
    else:
        main(config)
