"""What a step costs: the FLOPs its tokens need, the device's peak, memory high-water marks, a collective's latency.

    python perf.py          # this machine's peak FLOP/s per dtype (measured once on CPU, then read from the cache)

MFU (model FLOPs utilization, verl's perf/mfu/actor) is a phase's model FLOPs over its seconds times the device's
peak. Model FLOPs of a token, N the parameters its matmuls use: 2 N forward, 6 N forward and backward (4 N with
LoRA: the frozen base computes no weight gradients), plus attention's scores and mixing, 4 L H s a token forward
(L layers, H the query heads' width, s the sequence's length; no causal halving, as verl counts). Recomputation
(gradient checkpointing) is not counted: these are the model's FLOPs, not the hardware's.
"""

import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as tdist

from comm import synchronize

GB = 2**30
# dense FLOP/s by a substring of torch.cuda.get_device_name(): (bf16/fp16 tensor cores, fp32 without TF32)
GPU_PEAK = {"H200": (989e12, 67e12), "H100": (989e12, 67e12), "H800": (989e12, 67e12), "H20": (148e12, 44e12),
            "B200": (2250e12, 80e12), "A100": (312e12, 19.5e12), "A800": (312e12, 19.5e12),
            "L40S": (362e12, 91.6e12), "L40": (181e12, 90.5e12), "L4": (121e12, 30.3e12), "A10": (125e12, 31.2e12)}
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nanoverl", "peak_flops.json")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with open("/proc/cpuinfo") as f:  # the CPU's model, so a cached peak is never another machine's
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                     platform.processor())
    return f"{model} x{torch.get_num_threads()} threads"


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The device's dense FLOP/s in dtype: GPU_PEAK's spec-sheet figure for a known GPU, else measured once
    (matmul_peak) and cached in CACHE, keyed by the device's name (its thread count included) and the dtype."""
    name = device_name(device)
    if device.type == "cuda":
        for key, (half, single) in GPU_PEAK.items():
            if key in name:
                return single if dtype == torch.float32 else half
    key = f"{name} {dtype}"
    cached = json.loads(Path(CACHE).read_text()) if os.path.exists(CACHE) else {}
    if key not in cached:
        cached[key] = matmul_peak(device, dtype)
        os.makedirs(os.path.dirname(CACHE), exist_ok=True)
        tmp = Path(f"{CACHE}.{os.getpid()}.tmp")  # ranks measuring at once: each writes whole, the last rename wins
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, CACHE)
    return cached[key]


def matmul_peak(device: torch.device, dtype: torch.dtype) -> float:
    """Best FLOP/s of a square matmul in dtype on device over 5 tries: 2048 on CPU, 8192 on a GPU (to fill it)."""
    size = 8192 if device.type == "cuda" else 2048
    a = torch.randn(size, size, device=device).to(dtype)  # [size, size]
    best = float("inf")
    for _ in range(6):  # the first warms up
        synchronize()
        start = time.perf_counter()
        a @ a
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def model_shape(model: torch.nn.Module) -> dict:
    """What model_flops needs of an HF causal LM (or its critic): matmul parameters, attention's layers and width."""
    config = model.config
    embedding = model.get_input_embeddings().weight
    n = sum(p.numel() for p in model.parameters())  # DTensors count their global size; tied weights once
    if not getattr(config, "tie_word_embeddings", False):  # an embedding lookup is no matmul (a tied one is the head)
        n -= embedding.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"params": n, "layers": config.num_hidden_layers, "width": head_dim * config.num_attention_heads}


def model_flops(seqlens: torch.Tensor, shape: dict, backward: bool, lora: bool = False) -> float:
    """Model FLOPs of forward passes (backward: and their backward) over sequences of seqlens [B] tokens."""
    tokens, squares = seqlens.sum().item(), (seqlens.double() ** 2).sum().item()
    dense = 2 * shape["params"] * tokens  # forward
    attention = 4 * shape["layers"] * shape["width"] * squares  # forward: QK^T and AV
    if backward:  # twice the forward, the base's weight gradients left out under LoRA
        dense *= 2 if lora else 3
        attention *= 3
    return dense + attention


def reset_peak_memory(device: torch.device) -> int:
    """Start a new high-water mark of this process's memory; returns the memory in use now (bytes)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets the process's peak RSS (VmHWM)
        f.write("5")
    return proc_status("VmRSS")


def peak_memory(device: torch.device) -> int:
    """The high-water mark since reset_peak_memory (bytes): allocated device memory on GPU, RSS on CPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else proc_status("VmHWM")


def proc_status(key: str) -> int:
    """A memory line of /proc/self/status (VmRSS: resident now, VmHWM: peak since the last reset), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024  # the file counts kB


class OutOfMemory(RuntimeError):
    """An out-of-memory error named: the phase, the micro-batch and the limit in force, and the knobs that lower it."""


def is_oom(error: BaseException) -> bool:
    """A device's out-of-memory (torch.OutOfMemoryError) or the host's (the CPU allocator's, or Python's)."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or \
        (isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def allreduce_ms(group, device: torch.device, numel: int = 1 << 18) -> float:
    """Milliseconds of one all-reduce of numel fp32 values (1 MB) over group, after a barrier so that no rank's lateness
    counts: the interconnect's latency as the gradients' reduce-scatters see it (the first call also pays the
    connection's set-up). Collective."""
    x = torch.ones(numel, device=device)  # [numel]
    tdist.barrier(group=group)
    synchronize()
    start = time.perf_counter()
    tdist.all_reduce(x, group=group)
    synchronize()
    return (time.perf_counter() - start) * 1e3


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for dtype in (torch.float32, torch.bfloat16):
        print(f"{device_name(device)} {dtype}: {peak_flops(device, dtype) / 1e9:.0f} GFLOP/s")
