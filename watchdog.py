"""Which rank failed: a heartbeat per rank in torchrun's rendezvous store, so that when one rank dies or hangs the
others stop with an error that names it (RankFailure), instead of a bare collective error or a hang.

    torchrun --nproc_per_node=2 grpo.py            # ppo.train runs its loop inside watch_ranks(dist)
    python -m pytest tests/test_spmd.py -q -k rank # a rank killed (os._exit) or hung: the other names it

    with watch_ranks(dist): ...                    # under torchrun with several ranks; elsewhere the block as it is
"""

import os
import signal
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as tdist

from comm import Dist

HEARTBEAT_S = 0.5  # how often a rank bumps its counter in the store
SILENT_S = 3.0  # after a failure, a rank whose counter stays still this long is dead


class RankStopped(Exception):
    """SIGTERM: torchrun stops every rank when one of them exits."""


class RankFailure(RuntimeError):
    """This rank stops because another one died or got stuck; the message names it."""


class Heartbeat:
    """A thread that bumps this rank's counter in the rendezvous store every HEARTBEAT_S, through a client of its
    own. Under torchrun the store lives in the launcher (TORCHELASTIC_USE_AGENT_STORE), so it outlives any rank,
    and after a failure the survivors can tell which ranks died (counter still) from those that live."""

    def __init__(self, dist: Dist):
        self.rank, self.world = dist.rank, dist.world_size
        self.where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        self.store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=timedelta(seconds=10))
        self.prefix = f"nanoverl/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # a restart starts afresh
        self.lock = threading.Lock()  # one store client, two threads
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")
        self.thread.start()

    def _beat(self) -> None:
        while not self.done.wait(HEARTBEAT_S):
            try:
                with self.lock:
                    self.store.add(f"{self.prefix}/beat/{self.rank}", 1)
            except Exception:  # the launcher (the store) is gone: nobody is left to tell
                return

    def _counts(self) -> list[int]:
        with self.lock:
            return [self.store.add(f"{self.prefix}/beat/{r}", 0) for r in range(self.world)]

    def verdict(self, collective: bool) -> str | None:
        """What the other ranks did, after this one failed: died (counter still for SILENT_S), or, when a collective
        failed, stuck (alive but not failing with it). None when neither: the failure is this rank's own."""
        try:
            with self.lock:
                self.store.set(f"{self.prefix}/failed/{self.rank}", "1")
            before = self._counts()
            time.sleep(SILENT_S)
            after = self._counts()
            with self.lock:
                failed = {r for r in range(self.world) if self.store.check([f"{self.prefix}/failed/{r}"])}
        except Exception as e:
            return f"the rendezvous store at {self.where} is unreachable ({e}): the launcher died"
        others = [r for r in range(self.world) if r != self.rank]
        dead = [r for r in others if after[r] == before[r]]
        stuck = [r for r in others if r not in dead and r not in failed] if collective else []
        if dead:
            return (f"{_ranks(dead)} died: the heartbeat it kept in the rendezvous store stopped (its own output, or "
                    "torchrun's summary, says why)")
        if stuck:
            return (f"{_ranks(stuck)} is alive but did not take part in the collective that failed: stuck (a "
                    "collective waits dist_timeout_s for it)")
        return None

    def close(self) -> None:
        self.done.set()
        self.thread.join()


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _is_collective_error(error: BaseException) -> bool:
    """A failed or timed-out collective: NCCL's and the store's errors are DistErrors; gloo raises RuntimeErrors
    that carry its source path ("gloo/transport/tcp/pair.cc: Connection closed by peer", "Timed out waiting")."""
    return isinstance(error, tdist.DistError) or (isinstance(error, RuntimeError) and "gloo" in str(error))


def _stop(signum, frame):
    raise RankStopped("SIGTERM (torchrun stops every rank when one exits)")


@contextmanager
def watch_ranks(dist: Dist):
    """Under torchrun with several ranks: when the block fails because of another rank (a collective fails, or
    torchrun stops this rank with SIGTERM), raise a RankFailure that names the rank that died or got stuck, and
    that the same command resumes from the latest checkpoint. A failure of this rank's own passes unchanged.
    Elsewhere (one process, Ray's workers, whose driver watches them) the block runs as it is."""
    if dist.mesh is None or "TORCHELASTIC_USE_AGENT_STORE" not in os.environ:
        yield
        return
    heartbeat = Heartbeat(dist)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        yield
    except Exception as error:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's SIGTERM must not cut the verdict short
        collective = _is_collective_error(error)
        what = heartbeat.verdict(collective) if collective or isinstance(error, RankStopped) else None
        if what is None:
            raise
        raise RankFailure(f"rank {dist.rank} stops: {what}. Run the same command again to resume from the latest "
                          "checkpoint.") from error
    finally:
        signal.signal(signal.SIGTERM, previous)
        heartbeat.close()
