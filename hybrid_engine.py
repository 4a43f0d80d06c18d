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

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor, Shard

from comm import Dist, Max, timer
from perf import GB, peak_memory, reset_peak_memory
from core_algos import token_log_probs
from sharding import Merged, cast_dtype, full_tensor, full_weights, weight_groups

MB = 1 << 20
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

    def __post_init__(self):
        for name, ok, rule in (("bucket_mb", self.bucket_mb >= 0, ">= 0 (0: one layer a bucket)"),
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
        for bucket in full_weights(self.model, self.bucket_bytes, self.dtype, adapted_only):  # collective
            self.rollout.update_weights(self._tap(bucket, received))
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            names += [name for name, _ in bucket]
            buckets += 1
            del bucket  # else the loop variable keeps it alive while the next bucket is gathered
        if sorted(names) != expected:
            missing = sorted(set(expected) - set(names))
            wrong = sorted(n for n in set(names) if names.count(n) > 1 or n not in expected)
            raise RuntimeError(f"weight sync: the buckets left out {missing} and repeated or added {wrong}")
        self.synced, self.sent = True, set(expected)
        return nbytes, buckets

    def _tap(self, bucket: list[tuple[str, torch.Tensor]], received: dict):
        """Hand the bucket over one tensor at a time, fingerprinting each as the engine's loader takes it."""
        for name, tensor in bucket:
            if self.cfg.verify_sync:
                received[name] = checksum(tensor.reshape(-1), start=0).item()
            yield name, tensor

    def _verify(self, expected: dict[str, int], trainer: torch.Tensor, received: dict[str, int]) -> float:
        """sync_errors on this rank, the worst over all ranks (so that every rank raises, rather than the others
        waiting in the next collective); returns the probe's largest gap."""
        bad, gap = sync_errors(expected, received, self.rollout, self.probe, trainer)
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
    """Checksums of the trainer's full weights in the rollout dtype, computed from the local shards and summed across
    ranks (checksums add over shards), so no rank gathers anything but LoRA's merged weights. Collective under FSDP2."""
    names, sums, group = [], [], None
    for name, tensor in (entry for g in weight_groups(model) for entry in g):
        if isinstance(tensor, Merged):  # LoRA: the merge needs the full factors, so this one is gathered
            local, start = full_tensor(tensor, dtype), 0
            if isinstance(tensor.base, DTensor):  # every rank holds it whole: one rank's checksum counts
                group = tensor.base.device_mesh.get_group()
                local = local if tensor.base.device_mesh.get_local_rank() == 0 else local[:0]
        else:
            local, start = tensor.detach().to(cast_dtype(tensor, dtype)), 0
        if isinstance(local, DTensor):
            group = local.device_mesh.get_group()
            local, start = local.to_local(), _shard_offset(local)
        names.append(name)
        sums.append(checksum(local.reshape(-1), start).to(device))  # NCCL reduces device tensors
    sums = torch.stack(sums)  # [P] int64
    if group is not None:
        tdist.all_reduce(sums, group=group)  # integer sums: exact in any order
    return dict(zip(names, sums.tolist()))


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


def _shard_offset(tensor: DTensor) -> int:
    """Flat index, in the full tensor, of this rank's first element. FSDP2 shards dim 0 as torch.chunk does:
    ceil(rows / ranks) rows per rank, the last ones shorter or empty."""
    if tuple(tensor.placements) != (Shard(0),):
        raise ValueError(f"expected FSDP2's Shard(0) placement, got {tensor.placements}")
    rows, ranks = tensor.shape[0], tensor.device_mesh.size()
    first_row = min(tensor.device_mesh.get_local_rank() * math.ceil(rows / ranks), rows)
    return first_row * (tensor.numel() // max(rows, 1))


def release_host_memory() -> None:
    """Hand the free pages of this process's heap back to the OS (glibc's malloc_trim). glibc keeps the pages of
    freed tensors for later allocations; after a weight sync on CPU that is about a bucket and the engine's load
    temporaries, which other processes on the machine can then use."""
    if _malloc_trim is not None:
        _malloc_trim(0)
