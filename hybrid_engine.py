"""The 3D-HybridEngine of HybridFlow (Sheng et al. 2024) for one colocated worker per device: the actor's FSDP2 shards,
the rollout engine (vLLM) and the reference live in one process, which switches between train and rollout mode.

    OMP_NUM_THREADS=1 python -m pytest tests/test_hybrid_engine.py -q   # 2 torchrun ranks: checksums, probe, buckets
    OMP_NUM_THREADS=1 python bench/reshard.py                           # s/sync and peak memory vs naive and floor

API:
    hybrid = HybridEngine(model, rollout, dist, HybridConfig(), dtype=torch.bfloat16)
    with hybrid.rollout_mode(metrics, resident):   # train -> rollout: the trainer's weights streamed into the engine
        out = rollout.generate(...)                # on leaving, the engine sleeps

The worker moves its optimizer state off the device before (workers.ActorWorker.generate). Entering rollout mode,
within `resident` (the worker's context in which its parameters are on the device; offloaded, they wait on the host):
  0. with verify_sync, take the trainer's side of the verification (checksums from its shards, probe log-probs)
  1. wake the engine's weights (sleep level 2 dropped them: memory only, filled by the next step)
  2. stream the weights bucket by bucket: a bucket is the full_tensor() of whole decoder layers
     (sharding.full_weights), cast to the rollout dtype, loaded by the engine and dropped before the next one is
     gathered, so the trainer never holds a second full copy of the model (zero redundancy)
then, the parameters back where they wait:
  3. wake the KV cache, after the weights, so the two never peak together
  4. with verify_sync, prove that the engine received and computes with the trainer's weights (see _verify)
Leaving: the engine sleeps (VLLMRollout.sleep); on CPU the heap's free pages go back to the OS (release_host_memory).

A bucket never splits a decoder layer (sharding.weight_groups says why). Each load has a fixed cost (the loader visits
every module of the engine), small next to the memory that large buckets touch (bench/reshard.py measures both).

Why the gathers are not overlapped with the engine's loading: asynchronous all-gathers on gloo while the CPU engine
loaded layers corrupted the heap in bench/reshard.py, so each tensor is gathered when its bucket is built.

Metrics: timing_s/reshard, reshard/bytes, reshard/buckets, peak memory during the switch
(perf/max_memory_gb/reshard: allocated device memory on GPU, RSS on CPU) and reshard/max_memory_extra_gb (that peak
minus the memory at entry); with verify_sync also reshard/probe_logprob_diff_max (the engine-trainer log-prob
gap on the probe; ppo.py's rollout/logprob_diff_* give the gap on the sampled tokens of every step).
"""

import ctypes
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from comm import Dist, Max, timer
from perf import GB, peak_memory, reset_peak_memory
from core_algos import token_log_probs
from rollout import Slice
from sharding import (Block, Merged, holders, cast_dtype, engine_layout, full_tensor, full_weights,
                      weight_groups)

MB = 1 << 20
VOCAB_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")  # split over the vocabulary by a TP engine
CHECKSUM_CHUNK = 1 << 22  # bytes fingerprinted at a time: bounds the int64 temporaries to 64 MB
PROBE_SEQS = 4  # sequences in the probe batch
try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc: nothing to trim
    _malloc_trim = None


@dataclass
class HybridConfig:
    bucket_mb: float = 0.0
    """Size of one weight bucket streamed into the rollout engine, in MiB of the rollout dtype. A bucket holds
    whole decoder layers: a layer larger than this travels alone. 0: one layer (or other weight) a bucket, the
    least extra memory (the README's weight-sync section)."""
    verify_sync: bool = False
    """After every sync, prove that the engine holds the trainer's weights: per-parameter checksums of what it
    received, and a teacher-forced probe of its log-probs. Costs a forward pass and a few collectives."""
    verify_tol: float = 1e-4
    """Largest allowed log-prob gap of the probe between engine and trainer (fp32; bf16 needs a looser bound)."""
    probe_len: int = 16
    """Tokens per probe sequence (4 fixed random sequences); must be below the engine's max_model_len."""
    layout: Literal["slices", "full"] = "slices"
    """With training TP (fsdp.tp_size > 1): slices (HybridFlow's zero-redundancy resharding) hands each engine rank
    only its own block of every tensor-parallel weight, gathered over "dp" and over the tp ranks whose slices it
    lacks; full gathers every weight whole on every rank (the reference). Without training TP both are full."""

    def __post_init__(self):
        for name, ok, rule in (("bucket_mb", self.bucket_mb >= 0, ">= 0 (0: one layer a bucket)"),
                               ("layout", self.layout in ("slices", "full"), "slices or full"),
                               ("verify_tol", self.verify_tol > 0, "> 0"), ("probe_len", self.probe_len >= 2, ">= 2")):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)} must be {rule}")


class HybridEngine:
    """Switches one colocated worker between train mode (where it rests) and rollout mode."""

    def __init__(self, model: torch.nn.Module, rollout, dist: Dist, cfg: HybridConfig, dtype: torch.dtype):
        self.model, self.rollout, self.dist, self.cfg = model, rollout, dist, cfg
        self.dtype = dtype  # the rollout engine's dtype: weights are cast to it before the gather
        self.bucket_bytes = max(1, int(cfg.bucket_mb * MB))
        self.on_gpu = dist.device.type == "cuda"
        self.probe = probe_tokens(model.config.vocab_size, cfg.probe_len)  # [N, T]
        # the slice sync (with training TP): what this rank's engine keeps of each tensor-parallel weight
        self.layout = engine_layout(dist, getattr(rollout, "tp", 1)) if cfg.layout == "slices" else None
        # the embedding's and LM head's rows this rank's engine keeps (they are whole on every trainer tp rank)
        self.vocab_rows = rollout.vocab_rows() if self.layout is not None and self.layout.rollout_tp > 1 else None
        groups = weight_groups(model)
        self.names = sorted(name for group in groups for name, _ in group)  # what a sync hands over
        # LoRA: the groups holding adapted weights; once the engine has the base it keeps (no sleep: CPU), only these
        # change, so later syncs send only them
        self.adapted = sorted(name for group in groups if any(isinstance(t, Merged) for _, t in group)
                              for name, _ in group)
        self.synced, self.sent = False, set()
        rollout.sleep()  # train mode is the resting state: the engine wakes in rollout mode only

    @contextmanager
    def rollout_mode(self, metrics: dict, resident=nullcontext):
        """Train mode -> rollout mode for the block (weights synced into the engine) -> train mode. resident: a
        context in which the trainer's parameters are on its device (the worker's; they may wait in host memory)."""
        try:
            at_entry = reset_peak_memory(self.dist.device)
            expected, received = None, {}
            if self.cfg.verify_sync:  # the trainer's side of the verification first, where it computes
                with resident():
                    expected = (trainer_checksums(self.model, self.dtype, self.dist.device),
                                trainer_probe(self.model, self.probe, self.dist.device))
            with timer("reshard", metrics):
                with resident():
                    self.rollout.wake_up(tags=["weights"])
                    metrics["reshard/bytes"], metrics["reshard/buckets"] = self._stream(received)
                self.rollout.wake_up(tags=["kv_cache"])
            peak = peak_memory(self.dist.device)
            metrics["perf/max_memory_gb/reshard"] = Max(peak / GB)
            metrics["reshard/max_memory_extra_gb"] = (peak - at_entry) / GB
            if self.cfg.verify_sync:  # the checksums of what this sync sent (LoRA: the frozen rest was checked once)
                checksums = {name: value for name, value in expected[0].items() if name in self.sent}
                metrics["reshard/probe_logprob_diff_max"] = Max(self._verify(checksums, expected[1], received))
            yield
        finally:  # also when the sync or its verification failed: the worker goes back to train mode
            self.rollout.sleep()
            if not self.on_gpu:
                release_host_memory()  # the buckets' pages, else held while the trainer runs

    def _stream(self, received: dict) -> tuple[int, int]:
        """Every bucket into the engine, one at a time; returns (bytes, buckets) handed over, once it has checked
        that the buckets together handed over every weight exactly once (vLLM's loader is muted: rollout.py)."""
        nbytes, buckets, names = 0, 0, []
        adapted_only = bool(self.adapted) and self.synced and self.rollout.keeps_weights
        expected = self.adapted if adapted_only else self.names
        for bucket in full_weights(self.model, self.bucket_bytes, self.dtype, adapted_only, self.layout):  # collective
            handed = []  # the bytes of each tensor as the engine takes it (a block: its own part)
            self.rollout.update_weights(self._tap(bucket, received, handed))
            nbytes += sum(handed)
            names += [name for name, _ in bucket]
            buckets += 1
            del bucket  # else the loop variable keeps it alive while the next bucket is gathered
        if sorted(names) != expected:
            missing = sorted(set(expected) - set(names))
            wrong = sorted(n for n in set(names) if names.count(n) > 1 or n not in expected)
            raise RuntimeError(f"weight sync: the buckets left out {missing} and repeated or added {wrong}")
        self.synced, self.sent = True, set(expected)
        return nbytes, buckets

    def _tap(self, bucket: list[tuple[str, torch.Tensor | Block]], received: dict, handed: list):
        """Hand the bucket over one tensor at a time, fingerprinting each as the engine's loader takes it: received
        [name] its checksum, or for a Block (handed over as the Slice that vLLM's loaders narrow to it)
        received[name, offset] its block's."""
        for name, tensor in bucket:
            if self.vocab_rows and name.endswith(VOCAB_WEIGHTS) and not isinstance(tensor, Block):
                start, end = self.vocab_rows
                tensor = Block(tensor[start:end], 0, start, tuple(tensor.shape))
            if isinstance(tensor, Block):
                offset = tuple(tensor.start if d == tensor.dim else 0 for d in range(len(tensor.full_shape)))
                if self.cfg.verify_sync:
                    received[name, offset] = block_checksum(tensor.tensor, tensor.full_shape, offset).item()
                handed.append(tensor.tensor.numel() * tensor.tensor.element_size())
                tensor = Slice(tensor.tensor, tensor.full_shape, tensor.dim, tensor.start)
            else:
                handed.append(tensor.numel() * tensor.element_size())
                if self.cfg.verify_sync:
                    received[name] = checksum(tensor.reshape(-1), start=0).item()
            yield name, tensor

    def _verify(self, expected: dict[str, int], trainer: torch.Tensor, received: dict) -> float:
        """sync_errors on this rank, the worst over all ranks (so that every rank raises, rather than the others
        waiting in the next collective); returns the probe's largest gap. A whole tensor's checksum is this rank's
        to match; a block's (the slice sync) is matched by the blocks of every rank together (all_gather_object):
        the ranks that got one block agree on it, and the distinct blocks of a weight add up to its checksum."""
        whole = {k: v for k, v in received.items() if isinstance(k, str)}
        blocks = {k: v for k, v in received.items() if not isinstance(k, str)}
        everyone = [blocks]
        if self.dist.mesh is not None and self.layout is not None:
            everyone = [None] * self.dist.world_size
            tdist.all_gather_object(everyone, blocks)
        seen = {}  # (name, offset): the checksums the ranks that got that block computed
        for rank_blocks in everyone:
            for key, value in rank_blocks.items():
                seen.setdefault(key, set()).add(value)
        for (name, _), values in seen.items():
            whole[name] = whole.get(name, 0) + min(values)
        for name in {name for (name, _), values in seen.items() if len(values) > 1}:  # ranks disagree on a block
            whole[name] = None
        bad, gap = sync_errors(expected, whole, self.rollout, self.probe, trainer)
        worst = torch.tensor([float(len(bad)), gap], device=self.dist.device)  # [2]
        if self.dist.mesh is not None:
            tdist.all_reduce(worst, op=tdist.ReduceOp.MAX)
        n_bad, gap = worst.tolist()
        raise_on_sync_errors(bad or ("on another rank" if n_bad else []), gap, self.cfg.verify_tol)
        return gap


# ---- Verification of a sync (here and in the rollout pool, ray_trainer.py) ------------------------


def probe_tokens(vocab_size: int, probe_len: int) -> torch.Tensor:
    """The probe [N, T]: fixed random token ids, the same on every rank and at every sync."""
    return torch.randint(vocab_size, (PROBE_SEQS, probe_len), generator=torch.Generator().manual_seed(0))


def trainer_checksums(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """Checksums of the trainer's full weights in the rollout dtype, computed from the local shards (block_checksum:
    each element at its place in the full tensor), summed over every rank and divided by how many ranks hold each
    block (a shard replicated over "tp" is held tp times; integer sums divide exactly), so no rank gathers anything
    but LoRA's merged weights. Collective (one all-reduce) under torchrun."""
    names, sums, copies, distributed = [], [], [], False
    for name, tensor in (entry for g in weight_groups(model) for entry in g):
        sharded = isinstance(tensor.base if isinstance(tensor, Merged) else tensor, DTensor)
        distributed |= sharded
        if isinstance(tensor, Merged):  # LoRA: the merge needs the full factors, so this one is gathered
            local, offset, held_by = full_tensor(tensor, dtype), None, tdist.get_world_size() if sharded else 1
        else:
            local, offset, held_by = tensor.detach().to(cast_dtype(tensor, dtype)), None, 1
            if sharded:
                _, offset = compute_local_shape_and_global_offset(local.shape, local.device_mesh, local.placements)
                held_by, local = holders(local), local.to_local()
        names.append(name)
        copies.append(held_by)
        offset = tuple(offset or (0,) * local.dim())
        sums.append(block_checksum(local, tuple(tensor.shape), offset).to(device))  # NCCL reduces device tensors
    sums = torch.stack(sums)  # [P] int64
    if distributed:
        tdist.all_reduce(sums)  # integer sums: exact in any order
    return {name: total // n for name, total, n in zip(names, sums.tolist(), copies)}


@torch.no_grad()
def trainer_probe(model: torch.nn.Module, probe: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The trainer's teacher-forced log-probs [N, T - 1] of the probe's tokens 1..T-1 (on the CPU)."""
    ids = probe.to(device)  # [N, T]
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]  # [N, T - 1, V]: a small probe
    return token_log_probs(logits, ids[:, 1:])[0].cpu()  # [N, T - 1]


def sync_errors(expected: dict[str, int], received: dict[str, int], rollout, probe: torch.Tensor,
                trainer: torch.Tensor) -> tuple[list[str], float]:
    """(a) The weights whose checksum as the engine received them differs from the trainer's (or is missing); (b) the
    largest gap between the engine's teacher-forced log-probs on the probe and the trainer's. The engine's weights
    cannot be read back on CPU (its kernels repack them and leave empty placeholders), hence checksums at the
    hand-over plus a probe of what it computes."""
    bad = sorted(name for name in expected.keys() | received.keys() if expected.get(name) != received.get(name))
    engine = torch.tensor(rollout.prompt_log_probs(probe.tolist()))  # [N, T - 1]
    return bad, (engine - trainer).abs().max().nan_to_num(nan=math.inf).item()


def raise_on_sync_errors(bad: list[str] | str, gap: float, tol: float) -> None:
    if bad:
        raise RuntimeError(f"weight sync: the engine received weights that differ from the trainer's: {bad}")
    if gap > tol:
        raise RuntimeError(f"weight sync: the engine's probe log-probs differ from the trainer's by {gap:.3g} "
                           f"> verify_tol={tol}")


def checksum(flat: torch.Tensor, start: int) -> torch.Tensor:
    """An int64 fingerprint of the bytes of `flat`, elements start.. of a flattened full tensor: the sum of
    byte * (position % 251 + 1). Integer sums are exact in any order, so the fingerprints of a tensor's shards add
    up to the full tensor's; any one changed byte changes it (by a nonzero byte difference times 1..251)."""
    data = flat.contiguous().view(torch.uint8)  # [n * itemsize]
    first = start * flat.element_size()
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for offset in range(0, data.numel(), CHECKSUM_CHUNK):
        part = data[offset : offset + CHECKSUM_CHUNK].long()  # [c]
        position = torch.arange(first + offset, first + offset + part.numel(), device=flat.device)  # [c]
        total += (part * (position % 251 + 1)).sum()
    return total


def block_checksum(local: torch.Tensor, full_shape: tuple, offset: tuple) -> torch.Tensor:
    """checksum of a block of a full tensor: local [...] at offset (per dim) in a tensor of full_shape, each byte at
    its place in the full tensor, so the checksums of blocks that tile a tensor add up to its own. A block of whole
    rows is one contiguous run; a block of columns (a row-wise tensor-parallel slice) is one run per row."""
    if local.dim() < 2 or tuple(local.shape[1:]) == tuple(full_shape[1:]):
        return checksum(local.reshape(-1), offset[0] * math.prod(full_shape[1:]) if local.dim() else 0)
    if local.dim() > 2:
        raise ValueError(f"block_checksum: a {local.dim()}-d block split along a later dim ({tuple(local.shape)})")
    itemsize, (rows, cols) = local.element_size(), local.shape
    data = local.contiguous().view(torch.uint8)  # [rows, cols * itemsize]
    columns = offset[1] * itemsize + torch.arange(cols * itemsize, device=local.device)  # [cols * itemsize]
    total = torch.zeros((), dtype=torch.int64, device=local.device)
    step = max(1, CHECKSUM_CHUNK // max(1, cols * itemsize))  # rows a chunk
    for r in range(0, rows, step):
        row = offset[0] + r + torch.arange(min(step, rows - r), device=local.device)  # [s]
        position = row[:, None] * (full_shape[1] * itemsize) + columns[None, :]  # [s, cols * itemsize]
        total += (data[r : r + step].long() * (position % 251 + 1)).sum()
    return total


def release_host_memory() -> None:
    """Hand the free pages of this process's heap back to the OS (glibc's malloc_trim). glibc keeps the pages of
    freed tensors for later allocations; after a weight sync on CPU that is about a bucket and the engine's load
    temporaries, which other processes on the machine can then use."""
    if _malloc_trim is not None:
        _malloc_trim(0)
