"""Full fine-tuning against LoRA on the same model and batch, side by side: trainable parameters, optimizer-state
bytes, peak memory of the update, seconds per update, and the weight sync into vLLM (seconds and bytes; LoRA's
merged weights, the frozen ones sent once), against vLLM's own LoRA (the adapter written and loaded each step,
and generation with its kernels).

    python bench/lora.py                            # the 25M generation-bound size and a ~300M size (~10 min, 2 cores)
    python bench/lora.py --sizes 25M --rank 16

Each (size, mode) runs in a process of its own (a clean peak-memory mark), one process on the CPU, fp32 masters, the
in-process vLLM engine; the models are random Qwen2s with the byte tokenizer ("25M": bench/step.py's generation-bound
size; "300M": hidden 1024, 24 layers). The update is one optimizer step on `rows` sequences of 32 prompt and
`response` response tokens; the sync figures are the second sync's (the first sends everything in both modes).
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, not bench/

import torch  # noqa: E402
import tyro  # noqa: E402

from comm import init_distributed  # noqa: E402
from config import Config  # noqa: E402
from perf import peak_memory, reset_peak_memory  # noqa: E402
from sft import SFTConfig  # noqa: E402
from tiny import build_byte_tokenizer, build_tiny_qwen2  # noqa: E402
from step import GEN_MODEL  # noqa: E402
from workers import ActorWorker, pad_batch  # noqa: E402

SIZES = {"25M": GEN_MODEL,
         "300M": SFTConfig(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=8, intermediate_size=2816)}
ROWS = ("trainable params (M)", "optimizer state (MB)", "update peak RSS (GB)", "update RSS rise (GB)", "update (s)",
        "sync (s)", "sync (MB)")


@dataclass
class LoraBench:
    sizes: tuple[str, ...] = ("25M", "300M")
    """Model sizes (SIZES)."""
    rank: int = 8
    """LoRA rank (alpha = 2 x rank)."""
    rows: int = 4
    """Sequences in the update."""
    response: int = 128
    """Response tokens per sequence."""
    out_dir: str = "out/bench_lora"
    """Where the models and results go."""
    run: str | None = None
    """Internal: measure "SIZE/MODE" in this process."""


def model_folder(size: str, out_dir: str) -> str:
    path = os.path.join(out_dir, size)
    if not os.path.isfile(os.path.join(path, "config.json")):
        tokenizer = build_byte_tokenizer()
        build_tiny_qwen2(tokenizer, SIZES[size]).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def measure(size: str, mode: str, bench: LoraBench) -> dict:
    path = model_folder(size, bench.out_dir)
    cfg = Config(model_path=path, rollout_backend="vllm", rollout_n=1, train_batch_size=bench.rows,
                 ppo_mini_batch_size=bench.rows, ppo_micro_batch_size=bench.rows, max_prompt_length=32,
                 max_response_length=bench.response, lr=1e-5, lora_rank=bench.rank if mode == "lora" else 0,
                 lora_alpha=2.0 * bench.rank, out_dir=bench.out_dir)
    worker = ActorWorker(cfg, path, init_distributed())
    g = torch.Generator().manual_seed(0)
    vocab = worker.model.config.vocab_size
    prompts = [torch.randint(10, vocab, (32,), generator=g).tolist() for _ in range(bench.rows)]
    responses = [torch.randint(10, vocab, (bench.response,), generator=g).tolist() for _ in range(bench.rows)]
    syncs = [worker.generate(prompts[:1], seeds=[0])[1] for _ in range(2)]
    batch = pad_batch(prompts, responses, [[0.0] * bench.response] * bench.rows, worker.tokenizer.pad_token_id)
    batch["old_log_probs"] = worker.log_probs(batch)  # [B, R]
    batch["advantages"] = torch.randn(bench.rows, 1, generator=g) * batch["response_mask"]  # [B, R]
    worker.update(batch)  # the optimizer state exists from here on
    before = reset_peak_memory(worker.dist.device)
    start = time.perf_counter()
    worker.update(batch)
    seconds, peak = time.perf_counter() - start, peak_memory(worker.dist.device)
    state = sum(t.numel() * t.element_size() for s in worker.opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    worker.close()
    return {"trainable params (M)": sum(p.numel() for p in worker.model.parameters() if p.requires_grad) / 1e6,
            "optimizer state (MB)": state / 2**20, "update peak RSS (GB)": peak / 2**30,
            "update RSS rise (GB)": (peak - before) / 2**30,
            "update (s)": seconds, "sync (s)": syncs[1]["timing_s/reshard"],
            "sync (MB)": syncs[1]["reshard/bytes"] / 2**20}


def engine_lora(size: str, bench: LoraBench) -> dict:
    """vLLM's own LoRA instead of merged weights: the adapter written in peft's layout and loaded by the engine
    (add_lora, what each step would do), and generation with it against generation without."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from lora import add_adapters, export_adapter, is_adapter

    path = model_folder(size, bench.out_dir)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(model=path, dtype="float32", max_model_len=32 + bench.response, enforce_eager=True, seed=0,
              enable_lora=True, max_lora_rank=bench.rank, max_loras=1, kv_cache_memory_bytes=2**30)
    model = add_adapters(build_tiny_qwen2(build_byte_tokenizer(), SIZES[size]), bench.rank, 2.0 * bench.rank,
                         "all-linear")
    model.config._name_or_path = path
    adapters = {n: torch.randn_like(p) * 0.01 for n, p in model.named_parameters() if is_adapter(n)}
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 200, (32,), generator=g).tolist()} for _ in range(8)]
    params = SamplingParams(max_tokens=bench.response, ignore_eos=True, temperature=1.0, seed=0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    times = {}
    for version in (1, 2):  # the second load is the steady state
        start = time.perf_counter()
        folder = os.path.join(bench.out_dir, f"{size}-adapter-{version}")
        export_adapter(model, adapters, folder)
        llm.llm_engine.add_lora(LoRARequest(f"v{version}", version, folder))
        times["load"] = time.perf_counter() - start
    for name, request in (("plain", None), ("lora", LoRARequest("v2", 2, folder))):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=request)
        times[name] = time.perf_counter() - start
    return {"adapter into vLLM (s)": times["load"], "generate plain (s)": times["plain"],
            "generate with LoRA (s)": times["lora"]}


def main(bench: LoraBench) -> None:
    if bench.run:
        size, mode = bench.run.split("/")
        print("RESULT " + json.dumps(engine_lora(size, bench) if mode == "engine" else measure(size, mode, bench)))
        return
    os.makedirs(bench.out_dir, exist_ok=True)
    for size in bench.sizes:
        results = {}
        for mode in ("full", "lora", "engine"):
            argv = [sys.executable, __file__, "--run", f"{size}/{mode}", "--rank", str(bench.rank), "--rows",
                    str(bench.rows), "--response", str(bench.response), "--out-dir", bench.out_dir]
            out = subprocess.run(argv, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{size}/{mode} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
            results[mode] = json.loads(line[len("RESULT "):])
        print(f"\n{size} (rank {bench.rank}, {bench.rows} x (32 + {bench.response}) tokens)")
        print(f"{'':24s}{'full':>12s}{'lora':>12s}{'lora/full':>12s}")
        for row in ROWS:
            full, lora = results["full"][row], results["lora"][row]
            print(f"{row:24s}{full:12.3f}{lora:12.3f}{lora / full if full else float('nan'):12.3f}")
        engine = results["engine"]
        print(f"LoRA sync, merged weights {results['lora']['sync (s)']:.3f} s against vLLM's own LoRA: "
              f"{engine['adapter into vLLM (s)']:.3f} s to write and load the adapter; 8 x {bench.response} tokens "
              f"generated in {engine['generate plain (s)']:.2f} s plain, {engine['generate with LoRA (s)']:.2f} s "
              f"with the adapter ({engine['generate with LoRA (s)'] / engine['generate plain (s)']:.2f}x)")


if __name__ == "__main__":
    main(tyro.cli(LoraBench))
