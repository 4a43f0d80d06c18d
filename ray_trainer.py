"""The single controller on Ray (HybridFlow's hybrid programming model): one driver process runs the same step and
loop as torchrun (ppo.rl_step, ppo.loop) over worker groups of Ray actors, each group one torch process group.

    python ray_trainer.py                                    # local Ray, GRPO, 2 colocated workers on this CPU
    python ray_trainer.py --adv-estimator gae --ray.placement split --ray.cpus-per-worker 0.5   # PPO, critic apart
    python ray_trainer.py --help                             # config.Config's fields, plus --ray.* below
    python ray_trainer.py --ray.dashboard                    # the same, with Ray's dashboard (its URL is printed)
    sbatch --nodes=2 scripts/slurm_ray.sh --model-path ...   # a Slurm job: a Ray cluster, one worker a GPU
    python ray_trainer.py --ray.address auto --ray.workers 16 --model-path ...   # a cluster you started (ray start)
    python ray_trainer.py --ray.workers 1 --async.rollout-workers 1       # a rollout pool of its own, one-step-off
    python ray_trainer.py --ray.workers 1 --async.rollout-workers 1 --async.staleness 0   # the same pools, in turn
    python bench/async.py                                    # colocated vs split vs one-step-off, the ideal overlap

The driver holds no device. It keeps the whole batch of a step; a worker-group call splits the arguments that hold
a batch (a TensorDict, or the prompt and seed lists of generate) into contiguous chunks, one per data-parallel rank,
runs the method on every actor, and joins the results (verl's DP_COMPUTE: tensors concatenated, metrics reduced as
torchrun reduces them); a call with no batch goes to every actor (ONE_TO_ALL) and returns rank 0's answer. Data
moves through Ray's object store.

Placement: a pool is a Ray placement group of one bundle a device (a GPU, or a CPU slot here). colocated: actor,
rollout engine and reference (the hybrid engine) and the critic in one process a device; split: the critic in a
pool of its own, its work run beside the actor's where they do not depend on each other. A rollout pool of its own
(async.rollout_workers, RolloutPool below) generates ahead of the trainer. Every step reports each pool's busy and
idle seconds and perf/bubble/<pool>.

Fault tolerance: when a worker dies or does not answer within call_timeout_s, the driver logs which worker, method,
step and cause, kills the groups, starts new ones, loads the latest checkpoint and goes on. Sampling is seeded per
prompt and step, so the finished run equals an uninterrupted one; ray/restarts counts the restarts.
"""

import math
import os
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

import ray
import torch
import tyro
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tensordict import TensorDict

from batching import balance_whole
from comm import Max, barrier, combine_metrics, init_distributed, shutdown, timer
from config import Config, with_task_values
from data import load_reward_fn, load_tokenizer
from ppo import Run, check_out_dir, load_task, loop, score, warm_start_and_task_files
from rollout import RolloutOutput
from workers import ActorWorker, CriticWorker, RewardWorker, RolloutWorker, pad_batch

ROOT = os.path.dirname(os.path.abspath(__file__))
DEATH_GRACE_S = 30.0  # after a worker's error, how long to wait for news that a peer died (the likelier cause)


@dataclass
class RayConfig:
    workers: int = 2
    """Actor workers: one a device (its dp ranks); colocated, the critic runs in the same processes."""
    critic_workers: int | None = None
    """placement split: workers in the critic's own pool (None: as many as workers)."""
    placement: Literal["colocated", "split"] = "colocated"
    """colocated: every role in one pool, one process a device; split: the critic in a pool of its own."""
    reward_workers: int | None = None
    """With reward_model_path: workers in the reward model's own pool (HybridFlow's fourth model apart); None: it
    lives in the actor's processes, as the reference does."""
    cpus_per_worker: float = 1.0
    """CPUs of one bundle (one worker). Two 1-CPU workers fill a 2-core machine; split on it takes 0.5."""
    gpus_per_worker: int | None = None
    """GPUs of one bundle; None: 1 when the cluster has GPUs, else 0."""
    pin_cores: bool = False
    """CPU only: each worker (trainer or engine) gets cpus_per_worker cores of its own, numbered in the order the
    workers start, its threads and its vLLM engine's bound to them: one device each, as on GPUs (bench/async.py)."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How a pool's bundles spread over the nodes (Ray's placement strategies)."""
    address: str | None = None
    """None: start a local Ray instance; auto: join the running cluster (ray start); or a head's address."""
    dashboard: bool = False
    """A local Ray instance (address None) starts Ray's dashboard (http://127.0.0.1:8265 unless taken); either way the
    dashboard's URL is printed when there is one (a cluster's: scripts/slurm_ray.sh starts it on the head)."""
    call_timeout_s: float = 1800.0
    """A worker-group call with no answer in this time counts as a dead worker (a restart)."""
    max_restarts: int = 3
    """Restarts after worker failures before the run stops with an error."""
    fail_role: Literal["actor", "critic", "rollout"] | None = None
    """Fault injection: the role whose worker fails (None: none fails)."""
    fail_rank: int = 0
    """Fault injection: the failing worker's rank in its group."""
    fail_method: str = "update"
    """Fault injection: the worker method during which it fails (generate, log_probs, values, update, ...)."""
    fail_call: int = 1
    """Fault injection: it fails at this call of the method (generate: call 1 is the step-0 evaluation)."""
    fail_mode: Literal["exit", "hang"] = "exit"
    """Fault injection: exit hard (os._exit), or stop answering (sleep forever)."""
    fail_times: int = 1
    """Fault injection: the first this many incarnations of the groups fail (more than max_restarts: keeps dying)."""

    def __post_init__(self):
        bounds = {"workers": 1, "critic_workers": 1, "reward_workers": 1, "fail_call": 1, "fail_times": 1,
                  "max_restarts": 0}
        for name, low in bounds.items():
            if (value := getattr(self, name)) is not None and value < low:  # critic_workers None: as many as workers
                raise ValueError(f"ray.{name}={value} must be >= {low}")
        for name in ("cpus_per_worker", "call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ray.{name}={getattr(self, name)} must be > 0")
        if self.pin_cores and self.cpus_per_worker != int(self.cpus_per_worker):
            raise ValueError(f"ray.pin_cores: ray.cpus_per_worker={self.cpus_per_worker} must be whole cores")


@dataclass
class RayTrainerConfig:
    run: Annotated[Config, tyro.conf.arg(name="")] = field(
        default_factory=lambda: Config(adv_estimator="grpo", out_dir="out/ray"))
    """The run: the same Config as grpo.py and ppo.py (here GRPO's defaults, out_dir out/ray)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The controller's own settings."""


# ---- The worker side: one Ray actor a device, holding its roles' workers --------------------------


class WorkerHost:
    """One process of a worker group: it joins the group's torch process group and holds the workers of its roles
    (colocated: actor and critic; split: one of them). The driver calls their methods through call()."""

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: rank 0's, for the group's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, roles: list[str], cfg: Config, model_path: str, rank: int, world: int, master: tuple[str, int],
              fault: dict | None, cores: list[int] | None = None) -> dict:
        """Join the process group (comm's init from the torchrun variables) and build the workers; returns where it
        runs. A rollout pool's engine (roles ["rollout"]) joins no group: each engine stands alone. cores: the CPU
        cores this process and its engine's threads are bound to (ray.pin_cores)."""
        if cores:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        if roles != ["rollout"]:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR=master[0],
                              MASTER_PORT=str(master[1]))  # Ray gives each actor its own GPU as device 0
        self.dist, self.rank = init_distributed(cfg.dist_timeout_s), rank
        kinds = {"actor": ActorWorker, "critic": CriticWorker, "rollout": RolloutWorker,
                 "reward": lambda cfg, _, dist: RewardWorker(cfg, dist)}
        paths = {"critic": cfg.critic_model_path}  # None: the policy's
        self.workers = {role: kinds[role](cfg, paths.get(role) or model_path, self.dist) for role in roles}
        self.fault, self.calls = fault, Counter()
        return {"rank": rank, "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def call(self, role: str, method: str, *args, **kwargs) -> tuple:
        """(the method's answer, (start, end) wall-clock times of the call: the driver's busy accounting)."""
        self.calls[role, method] += 1
        f, rank, start = self.fault, self.rank, time.time()
        if f and (f["role"], f["rank"], f["method"], f["call"]) == (role, rank, method, self.calls[role, method]):
            print(f"[fault injection] {role} rank {rank}: {f['mode']} in {method}, call {f['call']}", flush=True)
            if f["mode"] == "exit":
                os._exit(1)
            time.sleep(10**9)
        out = getattr(self.workers[role], method)(*args, **kwargs)
        return out, (start, time.time())

    def shutdown(self) -> None:
        """After the run's last collective: close the engine (its cleanup destroys the default group), then leave."""
        barrier(self.dist)
        for worker in self.workers.values():
            worker.close()
        shutdown(self.dist)


# ---- The driver side: worker groups, their calls, and the controller the step runs with -----------


class WorkerFailure(Exception):
    """A worker died or stopped answering: the driver restarts the groups from the latest checkpoint."""


def _chunks(n: int, k: int) -> list[slice]:
    """k contiguous slices of n items, the first n % k one longer (the same split as torchrun's shards when k | n)."""
    bounds = [i * (n // k) + min(i, n % k) for i in range(k + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _join(parts: list):
    """Join one result per rank: tensors and TensorDicts concatenated, metrics reduced, tuples element-wise."""
    first = parts[0]
    if isinstance(first, tuple):
        return tuple(_join(list(p)) for p in zip(*parts))
    if isinstance(first, TensorDict) or torch.is_tensor(first):
        return torch.cat(parts)
    if isinstance(first, dict):
        return combine_metrics(parts)
    return first  # ONE_TO_ALL: rank 0's answer


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the spans (a span may be empty)."""
    total, reach = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > max(a, reach):
            total += b - max(a, reach)
            reach = b
    return total


def _nbytes(x) -> int:
    """Bytes of the tensors in x (what the driver sends or receives)."""
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(v) for v in x)
    if isinstance(x, TensorDict):
        return sum(t.numel() * t.element_size() for t in x.values())
    return x.numel() * x.element_size() if torch.is_tensor(x) else 0


class WorkerGroup:
    """One role's Ray actors as one worker: group.log_probs(batch) runs on every rank's chunk and joins the results;
    group.log_probs.submit(batch): a Pending. pool: names the devices, for the busy accounting (colocated: shared)."""

    def __init__(self, role: str, hosts: list, timeout: float, driver: "Driver", pool: str):
        self.role, self.hosts, self.timeout, self.driver, self.pool = role, hosts, timeout, driver, pool
        driver.busy.setdefault(pool, [])

    def __getattr__(self, method: str) -> "GroupMethod":
        return GroupMethod(self, method)

    def call_one(self, rank: int, method: str, *args) -> "Pending":
        """method(*args) on one host (no splitting, no joining)."""
        return Pending([self.hosts[rank]], self, method, [args], ranks=[rank])

    def call_each(self, method: str, args: list[tuple]) -> "Pending":
        """method(*args[rank]) on every host: one Pending, so that a dead host is found while the others wait."""
        return Pending(self.hosts, self, method, args)


class GroupMethod:
    def __init__(self, group: WorkerGroup, method: str):
        self.group, self.method = group, method

    def submit(self, *args, **kwargs) -> "Pending":
        """DP_COMPUTE when an argument holds a batch, else ONE_TO_ALL (the module's docstring); keyword arguments go
        to every rank as they are."""
        g, k = self.group, len(self.group.hosts)
        n = next((len(a) for a in args if isinstance(a, (TensorDict, list))), None)
        split = [[a[s] if isinstance(a, (TensorDict, list)) else a for a in args] for s in _chunks(n, k)] \
            if n is not None else [list(args)] * k
        g.driver.bytes_moved += sum(_nbytes(a) for a in args)
        return Pending(g.hosts, g, self.method, split, kwargs)

    def __call__(self, *args, **kwargs):
        return self.submit(*args, **kwargs).result()


class Pending:
    """A worker-group call in flight: one call a host; the driver's busy accounting gets the calls' times."""

    def __init__(self, hosts: list, group: WorkerGroup, method: str, args: list, kwargs: dict | None = None,
                 ranks: list[int] | None = None):
        refs = [h.call.options(num_returns=2).remote(group.role, method, *a, **(kwargs or {}))
                for h, a in zip(hosts, args)]
        self.refs, self.times = [r[0] for r in refs], [r[1] for r in refs]
        self.ranks = ranks or list(range(len(hosts)))  # each ref's rank in its group
        self.what, self.group = f"{group.role}.{method}", group
        group.driver.busy[group.pool].append((time.time(), self.times))

    def result(self):
        """Every rank's answer, joined. A rank that died, or no answer within the timeout, is a WorkerFailure that
        names the rank; an exception raised in the worker's code goes up as it is, unless a rank died meanwhile
        (its peers' collectives then fail with connection errors)."""
        waiting, deadline = list(self.refs), time.time() + self.group.timeout
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.time()))
            if not ready:
                ranks = [self.ranks[self.refs.index(r)] for r in waiting]
                raise WorkerFailure(f"{self.what}: rank(s) {ranks} gave no answer within {self.group.timeout:.0f} s")
            try:
                ray.get(ready[0])
            except RayActorError as e:
                raise WorkerFailure(self._died(ready[0], e)) from e
            except RayTaskError as e:  # did a peer die? then that is the failure to report
                for ref in waiting:
                    try:
                        ray.get(ref, timeout=DEATH_GRACE_S)
                    except RayActorError as death:
                        raise WorkerFailure(self._died(ref, death)) from e
                    except Exception:  # noqa: BLE001 (another rank's error, or still running: keep looking)
                        pass
                raise
        out = _join(ray.get(self.refs))
        self.group.driver.bytes_moved += _nbytes(out)
        return out

    def wait(self) -> None:
        """Until every rank's call has ended (or its host died), without fetching the answers."""
        ray.wait(self.times, num_returns=len(self.times), timeout=self.group.timeout)

    def _died(self, ref, error: Exception) -> str:
        rank = self.ranks[self.refs.index(ref)]
        return f"{self.what}: rank {rank} died ({type(error).__name__}: {str(error).splitlines()[0]})"


class Driver:
    """The single controller's view of the step (ppo.TorchrunController's methods): it holds the whole batch
    (dp_rank 0 of 1 for the data), computes every statistic over it (all_sum None), balances by reordering rows so
    that each rank's contiguous chunk is what torchrun's balancing would give it, and runs independent worker calls
    at once."""

    def __init__(self, ranks: int, restarts: int):
        self.dp_rank, self.dp_size, self.is_main, self.all_sum = 0, 1, True, None
        self.ranks, self.restarts, self.bytes_moved, self.last_step = ranks, restarts, 0, 0
        self.busy: dict[str, list] = {}  # pool: [(submitted at, the calls' time refs)] not yet accounted as finished

    def pipeline(self, seconds: float) -> dict:
        """Each pool's busy and idle seconds in the last `seconds` (the step) and perf/bubble (its idle share). A pool
        is busy while a call of it runs: from the call's start on the host (its submission while it has not
        finished) to its end."""
        now, out = time.time(), {}
        for pool, calls in self.busy.items():
            spans, left = [], []
            for submitted, times in calls:
                done, _ = ray.wait(times, num_returns=len(times), timeout=0)
                try:
                    ends = ray.get(done)
                except (RayActorError, RayTaskError):  # a failed call: not counted (reported where it is awaited)
                    continue
                if len(done) < len(times):
                    left.append((submitted, times))
                    spans.append((submitted, now))
                else:
                    spans.append((min(e[0] for e in ends), max(e[1] for e in ends)))
            self.busy[pool] = left
            busy = _covered([(max(a, now - seconds), min(b, now)) for a, b in spans])
            out.update({f"perf/busy_s/{pool}": busy, f"perf/idle_s/{pool}": seconds - busy,
                        f"perf/bubble/{pool}": (seconds - busy) / seconds})
        return out

    def balance(self, batch: TensorDict, seqlens: torch.Tensor, workloads: torch.Tensor, unit: int):
        return balance_whole(batch, seqlens, workloads, self.ranks, unit)

    def reduce(self, metrics: dict) -> dict:
        """The metrics as they are (worker groups reduced theirs over the ranks), with the controller's own."""
        out = {k: float(v) for k, v in metrics.items()}
        if "perf/throughput" in out:  # tokens per second per rank, as torchrun reports it
            out["perf/throughput"] /= self.ranks
        if "step" in metrics:  # a step's metrics (not an evaluation's)
            self.last_step = metrics["step"]
            out["ray/driver_bytes"], self.bytes_moved = float(self.bytes_moved), 0
            out.update(self.pipeline(metrics["timing_s/step"]))
        return {**out, "ray/restarts": float(self.restarts)}

    def all_max(self, values: list[float]) -> list[float]:
        """The values as they are: the driver holds the whole batch, there is nothing to agree on."""
        return [float(v) for v in values]

    def run_all(self, calls: dict, batch: TensorDict, metrics: dict) -> dict:
        """{key: method(batch)} for calls {key: (timer name, group method)}: all started, then all awaited (each
        timer is its call's span on the hosts, first start to last end)."""
        pending = {key: method.submit(batch) for key, (_, method) in calls.items()}
        out = {key: p.result() for key, p in pending.items()}
        for (name, _), p in zip(calls.values(), pending.values()):
            spans = ray.get(p.times)  # [(start, end)] on each host: the call's own time, not the others' it waited on
            metrics[f"timing_s/{name}"] = max(end for _, end in spans) - min(start for start, _ in spans)
        return out

    def barrier(self) -> None:
        """Nothing to wait for: every worker-group call returns when all its ranks are done."""


# ---- Pools, groups and the restarting run ---------------------------------------------------------


@dataclass
class Groups:
    actor: WorkerGroup
    critic: WorkerGroup | None
    reward: WorkerGroup | None
    hosts: list  # every Ray actor, to shut down or kill
    pools: list  # placement groups


def start_hosts(name: str, roles: list[str], n: int, cfg: Config, rc: RayConfig, model_path: str, incarnation: int,
                first: int) -> tuple:
    """A placement group of n bundles (one a device) and its n WorkerHost actors, one on each bundle, set up with
    roles (one process group, unless a rollout pool's), each one's place printed. incarnation: the hosts' earlier
    starts (fault injection fails the first ray.fail_times); first: the workers started before (ray.pin_cores)."""
    gpus = rc.gpus_per_worker if rc.gpus_per_worker is not None else int(ray.cluster_resources().get("GPU", 0) > 0)
    pool = placement_group([{"CPU": rc.cpus_per_worker, **({"GPU": gpus} if gpus else {})}] * n, strategy=rc.strategy)
    ray.get(pool.ready(), timeout=600)
    host_cls = ray.remote(WorkerHost)
    hosts = [host_cls.options(num_cpus=rc.cpus_per_worker, num_gpus=gpus, scheduling_strategy=(
        PlacementGroupSchedulingStrategy(pool, placement_group_bundle_index=i))).remote() for i in range(n)]
    # every host gets the plan: only a call of ray.fail_role's matches it (a rollout pool's hosts take only theirs)
    fault = None if rc.fail_role is None or incarnation >= rc.fail_times else dict(
        role=rc.fail_role, rank=rc.fail_rank, method=rc.fail_method, call=rc.fail_call, mode=rc.fail_mode)
    master = None if roles == ["rollout"] else ray.get(hosts[0].address.remote())
    infos = ray.get([h.setup.remote(roles, cfg, model_path, rank, n, master, fault, pinned(first + rank, rc))
                     for rank, h in enumerate(hosts)])
    for info in infos:
        print(f"[ray] {name} rank {info['rank']}: node {info['node'][:12]} pid {info['pid']}")
    return pool, hosts


def start_groups(cfg: Config, rc: RayConfig, model_path: str, driver: Driver, incarnation: int) -> Groups:
    """The pools and worker groups of the configured placement (start_hosts), each group its own process group."""
    with_critic = cfg.adv_estimator == "gae"
    layout = [("actor", ["actor", "critic"] if with_critic and rc.placement == "colocated" else ["actor"], rc.workers)]
    if with_critic and rc.placement == "split":
        layout.append(("critic", ["critic"], rc.critic_workers or rc.workers))
    if cfg.reward_model_path and rc.reward_workers:  # the reward model's own pool
        layout.append(("reward", ["reward"], rc.reward_workers))
    elif cfg.reward_model_path:
        layout[0][1].append("reward")
    groups, all_hosts, pools = {}, [], []
    for name, roles, n in layout:
        pool, hosts = start_hosts(name, roles, n, cfg, rc, model_path, incarnation, len(all_hosts))
        for role in roles:
            groups[role] = WorkerGroup(role, hosts, rc.call_timeout_s, driver, pool=name)
        all_hosts += hosts
        pools.append(pool)
    return Groups(groups["actor"], groups.get("critic"), groups.get("reward"), all_hosts, pools)


def pinned(host: int, rc: RayConfig) -> list[int] | None:
    """The cores of the host-th worker to start (ray.pin_cores), else None."""
    k = int(rc.cpus_per_worker)
    return list(range(host * k, host * k + k)) if rc.pin_cores else None


def stop_hosts(hosts: list, placements: list, clean: bool) -> None:
    """clean: the hosts close their engines and process groups first; then hosts and placement groups are removed."""
    if clean:
        ray.get([h.shutdown.remote() for h in hosts])
    for host in hosts:
        ray.kill(host)
    for placement in placements:
        remove_placement_group(placement)


# ---- The rollout pool: generation-only engines of their own, and one-step-off ---------------------


class Scorer:
    """A Ray actor of the rollout pool that scores each generated chunk as soon as it exists (HybridFlow pipelines
    reward behind generation through futures): one long-lived process, so no chunk waits for a process to start."""

    def __init__(self, model_path: str, reward_path: str | None, reward_name: str):
        self.tokenizer, self.reward_fn = load_tokenizer(model_path), load_reward_fn(reward_path, reward_name)

    def score(self, generated: tuple, rows: list[dict], n: int) -> tuple[list[float], float]:
        """(each response's score, seconds) of one chunk: generated is RolloutWorker.generate's answer."""
        start = time.perf_counter()
        scores = score(generated[0].responses, [r for r in rows for _ in range(n)], self.tokenizer, self.reward_fn)
        return scores.tolist(), time.perf_counter() - start


@dataclass
class Request:
    """A batch the pool generates: its rows, seeds, and per chunk (its rows, the generate call, the scoring task)."""
    rows: list[dict]
    seeds: list[int] | None
    greedy: bool
    chunks: list[tuple[slice, Pending, object]]


class RolloutPool:
    """Engines that only generate, on devices of their own (RolloutWorker, one a device), fed the trainer's weights
    after each update (sync), and the batches they generate ahead of the trainer (prefetch; ppo.feed_pool decides
    which, within async.staleness: with 1, batch k+1 is generated while the trainer updates on batch k, verl's
    one-step-off). Every sample carries the version of its weights; each chunk is scored as soon as it exists.

    Weight sync: ActorWorker.send_weights into each engine's receive_weights over a group of their own (side_group),
    checked as in the hybrid engine (hybrid.verify_sync). A dead engine, or one that does not take the weights within
    async.sync_timeout_s (hung): the pool is replaced (the old sync group aborted, new engines and group, the current
    weights), what it held generated again; the trainer goes on (ray.max_restarts counts it)."""

    def __init__(self, cfg: Config, rc: RayConfig, model_path: str, actor: WorkerGroup, driver: Driver, first: int):
        self.cfg, self.rc, self.model_path, self.actor, self.driver = cfg, rc, model_path, actor, driver
        self.first = first  # the trainer's workers, which took the first cores (ray.pin_cores)
        self.tokenizer = load_tokenizer(model_path)
        self.plan = actor.weights_plan()  # the buckets' names, shapes and dtypes, for the receiving side
        self.version, self.restarts, self.requests = 0, 0, {}  # requests: prefetched, by seeds
        self._start()

    # ---- the pool's hosts ----

    def _start(self) -> None:
        """New engines (the model from model_path) and a new weight-sync group with the trainer's rank 0."""
        rc, n = self.rc, self.cfg.async_.rollout_workers
        self.placement, self.hosts = start_hosts("rollout", ["rollout"], n, self.cfg, rc, self.model_path,
                                                 self.restarts, self.first)
        self.group = WorkerGroup("rollout", self.hosts, rc.call_timeout_s, self.driver, pool="rollout")
        self.scorer = ray.remote(Scorer).options(num_cpus=0).remote(self.model_path, self.cfg.reward_fn_path,
                                                                    self.cfg.reward_fn_name)
        address = ray.get(self.actor.hosts[0].address.remote())  # the trainer's rank 0 hosts the group's store
        joins = self.group.call_each("open_weight_sync", [(address, i + 1, n + 1) for i in range(n)])
        self.actor.open_weight_sync(address, n + 1)
        joins.result()

    def stop(self, clean: bool) -> None:
        stop_hosts(self.hosts, [self.placement], clean)
        ray.kill(self.scorer)

    def _restart(self, error: WorkerFailure) -> None:
        """Replace the pool after a failure: new engines with the trainer's current weights, and every prefetched
        batch submitted again."""
        while True:
            self.restarts += 1
            if self.restarts > self.rc.max_restarts:
                raise RuntimeError(f"the rollout pool kept failing: {self.restarts} failures, ray.max_restarts="
                                   f"{self.rc.max_restarts}; the last: {error}") from error
            print(f"[ray] rollout pool failure: {error}; restart {self.restarts} of at most {self.rc.max_restarts}: "
                  "new engines with the current weights (the trainer goes on)", file=sys.stderr, flush=True)
            self.stop(clean=False)
            try:
                self._start()
                self._sync()
                break
            except WorkerFailure as e:
                error = e
        self.requests = {key: self._submit(r.rows, r.seeds, r.greedy) for key, r in self.requests.items()}

    # ---- weights ----

    def sync(self, version: int) -> dict:
        """The trainer's current weights (the version-th) into every engine, once the generation in flight is done:
        its metrics (the wait, the sync's time and bytes, the probe's gap)."""
        self.version = version
        while True:
            try:
                return self._sync()
            except WorkerFailure as e:
                self._restart(e)

    def _sync(self) -> dict:
        start = time.perf_counter()
        for r in self.requests.values():  # what the engines are busy with first (the hosts run calls in order)
            for _, pending, _ in r.chunks:
                pending.wait()
        metrics = {"timing_s/wait_rollout_pool": time.perf_counter() - start}
        n = len(self.hosts)
        with timer("sync_rollout_weights", metrics):
            receive = self.group.call_each("receive_weights", [(self.plan, self.version)] * n)
            send = self.actor.send_weights.submit()
            try:  # the sender's end: every engine took every tensor, or one died or hung (async.sync_timeout_s)
                nbytes = send.result()
            except RayTaskError as e:
                waiting = ray.wait(receive.refs, num_returns=n, timeout=0)[1]
                ranks = [receive.ranks[receive.refs.index(r)] for r in waiting]
                cause = [line for line in str(e).splitlines() if line.strip()][-1]  # the trainer's own error
                raise WorkerFailure(f"rollout.receive_weights: rank(s) {ranks} did not take the weights ({cause})") \
                    from e
            receive.result()  # every engine acknowledged: these return at once
            metrics["sync/bytes"] = float(nbytes * n)
        if self.cfg.hybrid.verify_sync:
            expected = self.actor.sync_expectation()  # [checksums, probe log-probs]: rank 0's
            gaps = self.group.call_each("verify", [tuple(expected)] * n)
            gaps.result()  # an engine whose check failed raises here
            metrics["sync/probe_logprob_diff_max"] = Max(max(ray.get(gaps.refs)))  # each engine's gap
        return metrics

    # ---- generation ----

    def prefetch(self, rows: list[dict], seeds: list[int]) -> None:
        """Start generating (and scoring) the batch of these rows and seeds, unless it already is."""
        if tuple(seeds) not in self.requests:
            self.requests[tuple(seeds)] = self._submit(rows, seeds, greedy=False)

    def generate(self, rows: list[dict], seeds: list[int] | None, greedy: bool = False) -> tuple[TensorDict, dict]:
        """The scored batch (verl's layout, with "scores" and "version") of n responses per row (greedy: one), and
        its metrics: the prefetched batch for these seeds, or one generated now."""
        request = (self.requests.pop(tuple(seeds), None) if seeds else None) or self._submit(rows, seeds, greedy)
        while True:
            try:
                return self._collect(request)
            except WorkerFailure as e:
                self._restart(e)
                request = self._submit(rows, seeds, greedy)

    def _submit(self, rows: list[dict], seeds: list[int] | None, greedy: bool) -> Request:
        """Each engine a contiguous share of the rows, in async.score_chunks calls, each scored by a Ray task as soon
        as it is generated."""
        cfg, chunks = self.cfg, []
        for rank, share in enumerate(_chunks(len(rows), len(self.hosts))):
            for part in _chunks(share.stop - share.start, cfg.async_.score_chunks):
                rows_part = slice(share.start + part.start, share.start + part.stop)
                if rows_part.start == rows_part.stop:
                    continue
                prompts = [r["prompt_ids"] for r in rows[rows_part]]
                pending = self.group.call_one(rank, "generate", prompts, seeds and seeds[rows_part], greedy)
                scores = self.scorer.score.remote(pending.refs[0], rows[rows_part], 1 if greedy else cfg.rollout_n)
                chunks.append((rows_part, pending, scores))
        return Request(rows, seeds, greedy, chunks)

    def _collect(self, request: Request) -> tuple[TensorDict, dict]:
        start, n = time.perf_counter(), 1 if request.greedy else self.cfg.rollout_n
        outs = [pending.result() for _, pending, _ in request.chunks]  # a dead engine: WorkerFailure
        scores = ray.get([s for _, _, s in request.chunks])
        prompts = [r["prompt_ids"] for r in request.rows for _ in range(n)]
        out = RolloutOutput.cat([o[0] for o in outs])
        batch = pad_batch(prompts, out.responses, out.log_probs, self.tokenizer.pad_token_id, None, out.masks,
                          out.counts)  # widths None: the longest prompt's and response's, as colocated
        batch["version"] = torch.tensor([o[1] for o in outs for _ in o[0].responses])  # [B]
        batch["scores"] = torch.tensor([x for s, _ in scores for x in s])  # [B]
        gen = Counter()  # seconds each engine generated
        for (part, pending, _), out in zip(request.chunks, outs):
            gen[pending.ranks[0]] += out[2]
        return batch, {"timing_s/gen": max(gen.values()), "timing_s/reward": sum(t for _, t in scores),
                       "timing_s/wait_rollout": time.perf_counter() - start, "async/rollout_restarts": self.restarts}


def check(cfg: Config, rc: RayConfig) -> None:
    """What Config cannot check alone: the batch sizes against the groups' ranks."""
    if rc.reward_workers and not cfg.reward_model_path and cfg.task != "arith-rlhf":  # arith-rlhf brings its own
        raise ValueError(f"ray.reward_workers={rc.reward_workers}: a reward model's pool, but no reward model "
                         "(--reward-model-path, or --task arith-rlhf)")
    for name, n in (("ray.workers", rc.workers), ("ray.critic_workers", rc.critic_workers),
                    ("ray.reward_workers", rc.reward_workers)):
        if n and (cfg.train_batch_size % n or cfg.ppo_mini_batch_size % n):
            raise ValueError(f"train_batch_size={cfg.train_batch_size} and ppo_mini_batch_size="
                             f"{cfg.ppo_mini_batch_size} must divide by {name}={n}")
    if cfg.rollout_backend == "hf" and rc.workers > 1 and not cfg.async_.rollout_workers:
        raise ValueError("rollout_backend='hf' runs in one process only; use 'vllm' with several workers")
    if cfg.fsdp.tp_size > 1:
        raise ValueError(f"fsdp.tp_size={cfg.fsdp.tp_size}: training tensor parallelism runs under torchrun "
                         "(torchrun --nproc_per_node=N grpo.py --fsdp.tp-size K); the Ray controller's groups are "
                         "data-parallel")
    if cfg.rollout_tp > 1:  # an engine sharded over a worker group's ranks has not been run on the Ray controller
        raise ValueError(f"rollout_tp={cfg.rollout_tp}: the Ray controller's engines (colocated or a rollout pool's) "
                         "run one a worker (rollout_tp 1); a tensor-parallel engine runs under torchrun "
                         "(torchrun --nproc_per_node=N grpo.py --rollout-tp K)")


def train(rc_all: RayTrainerConfig) -> list[dict]:
    """Run the loop from the driver, restarting the worker groups from the latest checkpoint after a failure."""
    cfg, rc = with_task_values(rc_all.run), rc_all.ray
    check(cfg, rc)
    check_out_dir(cfg)  # once: a restart resumes the same run in the same folder
    os.makedirs(cfg.out_dir, exist_ok=True)
    if not ray.is_initialized():
        env = {"PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}  # the workers import ours
        context = ray.init(address=rc.address, runtime_env={"env_vars": env}, include_dashboard=rc.dashboard,
                           **({} if rc.address else {"num_cpus": max(os.cpu_count() or 1, 2)}))
        if url := context.dashboard_url:
            print(f"[ray] dashboard: {url if '://' in url else 'http://' + url}", flush=True)
    model_path, train_files, val_files, *reward_model = warm_start_and_task_files(cfg, init_distributed())  # no group
    if reward_model:  # --task arith-rlhf's learned reward model
        cfg = replace(cfg, reward_model_path=reward_model[0])
    task = load_task(cfg, model_path, train_files, val_files, 1)  # bad data: named before any worker starts
    restarts = 0
    while True:
        driver, groups, pool = Driver(rc.workers, restarts), None, None
        try:
            groups = start_groups(cfg, rc, model_path, driver, restarts)
            if cfg.async_.rollout_workers:
                pool = RolloutPool(cfg, rc, model_path, groups.actor, driver, first=len(groups.hosts))
            records = loop(Run(cfg, task, groups.actor, groups.critic, driver, pool, groups.reward))
            if pool:
                pool.stop(clean=True)
            stop_hosts(groups.hosts, groups.pools, clean=True)
            return records
        except WorkerFailure as e:
            restarts += 1
            if pool:
                pool.stop(clean=False)
            if groups:
                stop_hosts(groups.hosts, groups.pools, clean=False)
            where = f"after step {driver.last_step} completed" if driver.last_step else "before step 1 completed"
            if restarts > rc.max_restarts:
                raise RuntimeError(f"workers kept failing: {restarts} failures, ray.max_restarts={rc.max_restarts}; "
                                   f"the last {where}: {e}") from e
            print(f"[ray] worker failure {where}: {e}; restart {restarts} of at most {rc.max_restarts}: new worker "
                  "groups, resuming from the latest checkpoint", file=sys.stderr, flush=True)


if __name__ == "__main__":
    train(tyro.cli(RayTrainerConfig))
