"""Process groups for torchrun (SPMD) runs: the torchrun env, a DeviceMesh, metric reduction, object broadcast.

    torchrun --nproc_per_node=2 your_script.py      # gloo on CPU, NCCL on GPU, one process per device
    python your_script.py                           # one process, no process group: every helper is the identity
    OMP_NUM_THREADS=1 python -m pytest tests/test_sharding.py -q     # the tests (they launch torchrun)

API (the whole of it):
    dist = init_distributed(timeout_s=1800, tp=2)         # -> Dist(rank, world_size, local_rank, device, mesh, is_main)
    dist.dp_rank, dist.dp_size                            # this rank's data shard: split batches by these
    dist.tp_rank, dist.tp_size                            # its place in its tensor-parallel group (same data)
    reduce_metrics({"actor/pg_loss": x, "response_length/max": Max(m), "tokens": Sum(n)}, dist)
        # each value reduced over the ranks as its type declares: Sum, Max, Min, or a plain number (the mean)
    combine_metrics([rank0_metrics, rank1_metrics])       # reduce_metrics' numbers, from a list in one process
    all_sum = all_sum_fn(dist)                            # t -> t summed over the dp ranks (None in one process)
    all_max([width, count], dist)                         # each value's largest over the ranks: what they agree on
    obj = broadcast_object(obj, dist, src=0)               # every rank gets src's python object
    group = side_group(("10.0.0.1", 29600), rank, size, device, timeout_s)   # a group beside the default one
    broadcast(group, tensor, timeout_s)                   # rank 0's tensor over such a group (the pool's weight sync)
    side_barrier(group, device, timeout_s)                # every member got there, or an error after timeout_s
    barrier(dist)
    shutdown(dist)                                        # barrier, then destroy the process group (if still there)
    with timer("gen", metrics): ...                       # metrics["timing_s/gen"] = seconds

The mesh is ("dp", "tp"): groups of tp consecutive ranks share one shard of the data and split each decoder layer's
matmuls (sharding.parallelize: tensor parallelism); FSDP2 shards the parameters over "dp". With tp 1 (the default) it
is plain data parallelism. Within a tp group the tp coordinates are ordered so that a rollout engine sharded over
fewer ranks (rollout_tp dividing tp) finds the trainer slices it needs on the ranks of its own engine rank (tp_layout).
"""

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch.distributed.device_mesh import DeviceMesh


@dataclass
class Dist:
    """Where this process sits in the run; mesh is None in a single process (no process group)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None
    is_main: bool

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size() if self.mesh is not None else 1

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank() if self.mesh is not None else 0

    @property
    def tp_size(self) -> int:
        return self.mesh["tp"].size() if self.mesh is not None else 1


def tp_layout(world: int, tp: int, rollout_tp: int = 1) -> torch.Tensor:
    """The mesh's ranks [dp, tp]: tp consecutive ranks a group, tp coordinate t held by the group's rank
    (t % g) * rollout_tp + t // g, g = tp / rollout_tp. vLLM forms its engines' TP groups from consecutive ranks, so
    engine rank e is every rank with rank % rollout_tp == e; this order gives it the trainer's slices e*g .. e*g+g-1
    on exactly those ranks of the group (the identity when rollout_tp is 1 or tp)."""
    g = tp // rollout_tp
    local = torch.tensor([(t % g) * rollout_tp + t // g for t in range(tp)])  # [tp]
    return torch.arange(0, world, tp)[:, None] + local[None, :]  # [dp, tp]


def init_distributed(timeout_s: int = 1800, tp: int = 1, rollout_tp: int = 1) -> Dist:
    """Join the torchrun job described by the env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or run alone.
    tp: the mesh's tensor-parallel size (it must divide the world); rollout_tp: see tp_layout."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:  # plain `python script.py`
        return Dist(0, 1, 0, torch.device("cuda", 0) if cuda else torch.device("cpu"), None, True)
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if world % tp or tp % rollout_tp and rollout_tp % tp:
        raise ValueError(f"fsdp.tp_size={tp} must divide the {world} ranks (and rollout_tp={rollout_tp} divide it)")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        # verl's performance tuning guide, where the user set nothing, before the CUDA context exists: one hardware
        # queue (communication kernels launch in issue order), NCCL streams at high priority (collectives are not
        # starved by compute). NCCL_PROTO is left to the user: the best value depends on the interconnect.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        os.environ.setdefault("TORCH_NCCL_HIGH_PRIORITY", "1")
        torch.cuda.set_device(device)
    # device_id binds NCCL to this rank's GPU (eager init, and barriers know their device)
    tdist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                             device_id=device if cuda else None)
    layout = tp_layout(world, tp, rollout_tp if tp % rollout_tp == 0 else 1)  # [dp, tp]
    mesh = DeviceMesh(device.type, layout, mesh_dim_names=("dp", "tp"))
    return Dist(rank, world, local_rank, device, mesh, rank == 0)


class Sum(float):
    """A metric value the ranks add up (a count): its type, never its name, declares the reduction (reduce_metrics)."""

    op = "sum"


class Max(float):
    """A metric value whose reduction over the ranks (and over micro- and mini-batches) is the largest."""

    op = "max"


class Min(float):
    """A metric value whose reduction over the ranks is the smallest."""

    op = "min"


REDUCTIONS = {"sum": (torch.sum, Sum), "max": (torch.amax, Max), "min": (torch.amin, Min), "mean": (torch.mean, float)}


def reduce_metrics(metrics: dict[str, float], dist: Dist) -> dict[str, float]:
    """The same dict on every dp rank, each value reduced by the op its type declares (Sum, Max, Min; else the
    mean), and of that type still. Every rank must pass the same keys, with the same types."""
    if dist.mesh is None:
        return combine_metrics([metrics])
    keys = sorted(metrics)  # same order on every rank
    # one all_gather of a packed vector instead of one collective per key; float64 keeps token counts exact
    local = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=dist.device)  # [K]
    gathered = torch.empty(dist.dp_size * len(keys), dtype=torch.float64, device=dist.device)  # [dp * K]
    tdist.all_gather_into_tensor(gathered, local, group=dist.mesh["dp"].get_group())
    return _reduce_rows(gathered.view(dist.dp_size, len(keys)).cpu(), keys, metrics)  # [dp, K]


def combine_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """reduce_metrics for a process that holds every rank's metrics (a single controller): the same numbers."""
    keys = sorted(per_rank[0])
    return _reduce_rows(torch.tensor([[float(m[k]) for k in keys] for m in per_rank], dtype=torch.float64), keys,
                        per_rank[0])


def _reduce_rows(rows: torch.Tensor, keys: list[str], example: dict) -> dict[str, float]:
    """Each column of rows [ranks, K] reduced by the op of example[key]'s type."""
    out = {}
    for i, k in enumerate(keys):
        reduce, kind = REDUCTIONS[getattr(example[k], "op", "mean")]
        out[k] = kind(reduce(rows[:, i]).item())
    return out


def all_max(values: list[float], dist: Dist) -> list[float]:
    """Each value's largest over the dp ranks (a collective: every rank passes as many): what the ranks must agree
    on, e.g. the padded widths of a batch whose rows may move between them."""
    if dist.mesh is None:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=dist.device)  # [K]
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=dist.mesh["dp"].get_group())
    return t.tolist()


def all_sum_fn(dist: Dist):
    """A function that sums a tensor over the dp ranks (a collective: every rank calls it with the same shape), or
    None in a single process, where the data is all here: what core_algos' `all_sum` arguments take."""
    if dist.mesh is None:
        return None

    def all_sum(t: torch.Tensor) -> torch.Tensor:
        out = t.to(dist.device, copy=True)  # NCCL reduces device tensors; the caller's t stays as it was
        tdist.all_reduce(out, group=dist.mesh["dp"].get_group())
        return out.to(t.device)

    return all_sum


def broadcast_object(obj, dist: Dist, src: int = 0):
    """src's picklable `obj` on every rank (e.g. a resume path decided by rank 0)."""
    if dist.mesh is None:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def side_group(address: tuple[str, int], rank: int, size: int, device: torch.device, timeout_s: float):
    """A process group of its own between processes that already belong to other groups (the trainer's rank 0 and
    the rollout pool's engines, ray_trainer.py): rendezvous at a TCP store that rank 0 hosts at address; gloo on
    CPU, NCCL on GPU. Not the default group, so each process keeps its own. Its collectives wait timeout_s
    (broadcast, side_barrier); NCCL's own watchdog gets twice that, so that the waiting rank raises, and aborts the
    group (ProcessGroup.abort), before the watchdog would end the process."""
    timeout = timedelta(seconds=timeout_s)
    store = tdist.TCPStore(address[0], address[1], size, is_master=rank == 0, timeout=timeout)
    if device.type == "cuda":
        options = tdist.ProcessGroupNCCL.Options()
        options._timeout = 2 * timeout
        return tdist.ProcessGroupNCCL(store, rank, size, options)
    return tdist.ProcessGroupGloo(store, rank, size, timeout)


def broadcast(group, tensor: torch.Tensor, timeout_s: float) -> None:
    """tensor from rank 0 to every rank of a side_group (in place on the others): BroadcastOptions' default root.
    Waits at most timeout_s (a dead NCCL peer would never make a plain wait() return), then raises."""
    group.broadcast([tensor], tdist.BroadcastOptions()).wait(timedelta(seconds=timeout_s))


def side_barrier(group, device: torch.device, timeout_s: float) -> None:
    """Every member of a side_group reached this point (a one-element all-reduce), or an error after timeout_s. A
    root's broadcast can finish while a receiver that stopped answering never read it (gloo hands small tensors to
    the socket): this is what proves that each receiver took every tensor."""
    group.allreduce([torch.zeros(1, device=device)]).wait(timedelta(seconds=timeout_s))


def barrier(dist: Dist) -> None:
    if dist.mesh is not None and tdist.is_initialized():
        tdist.barrier()


def shutdown(dist: Dist) -> None:
    """Barrier then destroy the group: without the barrier a rank occasionally aborts at exit (seen with gloo).
    Guarded by is_initialized(): an in-process vLLM engine's shutdown may have destroyed the default group already."""
    if dist.mesh is not None and tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()


def synchronize() -> None:
    """Wait for this process's queued GPU work (kernels launch asynchronously); nothing to wait for on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextmanager
def timer(name: str, metrics: dict):
    """Wall time of the block, as metrics["timing_s/<name>"] (verl's metric names), the block's GPU work included."""
    synchronize()
    start = time.perf_counter()
    yield
    synchronize()
    metrics[f"timing_s/{name}"] = time.perf_counter() - start
