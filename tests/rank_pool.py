"""Rank processes kept for a test file, for the engine tests that drive SPMD ranks themselves (FSDP2, tensor and
sequence parallel training on 2 or 4 gloo ranks) rather than through a WorkerGroup.

A Ray actor spends seconds of CPU importing torch, transformers and FSDP before its first call, and these tests used
to start 2 to 4 of them per case. The pool keeps up to four processes for a test file (conftest's ``rank_pool``).
Each use forms a new gloo process group of the size it asks for on the first processes and places an object of the
test's own class on every rank; leaving drops the objects and destroys the group. A use that raises (a failed
assertion, a rank's error, a timeout) kills the processes, so the next use starts new ones: nothing of a failed case
can reach the next.
"""

from __future__ import annotations

import datetime
import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

# Ray workers cannot import this module by name (pytest put tests/ on sys.path only here): ship it by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CALL_TIMEOUT_S = 600
LOOPBACK = "127.0.0.1"


# No logical CPU held: the processes sit idle between uses, and groups placed by the cluster's other users (run_training,
# WorkerGroup tests) must find its CPUs free.
@ray.remote(num_cpus=0)
class RankHost:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.obj = None

    def hold_port(self) -> int:
        """A port for the next group's rendezvous store, listened on by this process (rank 0's) until the store takes
        it: a port only looked up could be taken by another socket on the host before the store starts."""
        from hybridflow.common.ports import hold_free_port

        return hold_free_port(LOOPBACK)

    def join(self, rank: int, world: int, port: int, cls: type, args: tuple, kwargs: dict) -> None:
        import torch.distributed as dist

        from hybridflow.common.ports import tcp_store

        self.leave()
        store = tcp_store(LOOPBACK, port, world, rank == 0, datetime.timedelta(seconds=CALL_TIMEOUT_S))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        self.obj = cls(*args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.obj, method)(*args, **kwargs)

    def leave(self) -> None:
        import torch.distributed as dist

        self.obj = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


class RankPool:
    MAX_WORLD = 4

    def __init__(self) -> None:
        self.hosts: list = []

    def _hosts(self, world: int) -> list:
        if not 1 <= world <= self.MAX_WORLD:
            raise ValueError(f"the rank pool holds 1 to {self.MAX_WORLD} ranks; asked for {world}")
        while len(self.hosts) < world:
            self.hosts.append(RankHost.remote())
        return self.hosts[:world]

    def kill(self) -> None:
        for host in self.hosts:
            ray.kill(host)
        self.hosts = []

    @contextmanager
    def spmd(self, world: int, cls: type, *args: Any, **kwargs: Any) -> Iterator[list]:
        """``world`` ranks in a new gloo group, each holding ``cls(*args, **kwargs)`` (built after the group is up,
        so it may call ``torch.distributed`` in its constructor); call them with ``on_all``."""
        hosts = self._hosts(world)
        clean = False
        try:
            port = ray.get(hosts[0].hold_port.remote(), timeout=CALL_TIMEOUT_S)
            ray.get([h.join.remote(r, world, port, cls, args, kwargs) for r, h in enumerate(hosts)],
                    timeout=CALL_TIMEOUT_S)
            yield hosts
            ray.get([h.leave.remote() for h in hosts], timeout=CALL_TIMEOUT_S)
            clean = True
        finally:
            if not clean:
                self.kill()


def on_all(ranks: list, method: str, *per_rank_args: list, **kwargs: Any) -> list:
    """Call ``method`` of every rank's object at once (collectives need all of them); ``per_rank_args[i]`` goes to
    rank i."""
    refs = [h.call.remote(method, *(args[r] for args in per_rank_args), **kwargs) for r, h in enumerate(ranks)]
    return ray.get(refs, timeout=CALL_TIMEOUT_S)
