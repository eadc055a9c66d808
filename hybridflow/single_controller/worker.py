"""`Worker`: the base class of everything a WorkerGroup runs, one instance per rank.

A worker knows where it sits in its group -- ``rank``, ``world_size``, ``local_rank`` (index among the group's ranks
on the same node), ``master_addr`` / ``master_port`` (the rendezvous on rank 0's node) -- and can join the group's
torch.distributed process group with ``init_distributed()``. The group passes that position before ``__init__`` runs:
in the torch-standard environment variables RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
on the Ray backend (each rank is its own process), and in-process for the local backend (so the driver's environment
is left alone). A Worker built outside any group is rank 0 of 1.

Threads: Ray sets OMP_NUM_THREADS to the actor's ``num_cpus``, which leaves torch one intra-op thread. ``__init__``
applies the group's ``num_threads`` (passed as HYBRIDFLOW_NUM_THREADS); ``set_num_threads(n)`` changes it later.
"""

from __future__ import annotations

import contextvars
import datetime
import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from hybridflow import device
from hybridflow.common.ports import tcp_store

NUM_THREADS_ENV = "HYBRIDFLOW_NUM_THREADS"


@dataclass(frozen=True)
class WorkerContext:
    """A rank's place in its group, handed to the worker before its __init__ runs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    num_threads: int | None = None

    def to_env(self) -> dict[str, str]:
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
        if self.num_threads:
            env[NUM_THREADS_ENV] = str(self.num_threads)
        return env

    @classmethod
    def from_env(cls) -> WorkerContext:
        env = os.environ
        threads = env.get(NUM_THREADS_ENV)
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 0)),
            num_threads=int(threads) if threads else None,
        )


# Set by the local backend while it constructs a worker in the driver process (instead of touching os.environ).
_CONSTRUCTION_CONTEXT: contextvars.ContextVar[WorkerContext | None] = contextvars.ContextVar(
    "hybridflow_worker_context", default=None
)


@dataclass(frozen=True)
class DPMeshInfo:
    """One rank's position on a named mesh's data-parallel axis."""

    dp_rank: int
    dp_size: int
    is_collector: bool


class Worker:
    """Base class for worker roles (actor, critic, ...). Subclasses must call ``super().__init__()``."""

    def __init__(self) -> None:
        ctx = _CONSTRUCTION_CONTEXT.get() or WorkerContext.from_env()
        self._context = ctx
        self._dp_meshes: dict[str, DPMeshInfo] = {}
        if ctx.num_threads:
            device.set_num_threads(ctx.num_threads)

    # ------------------------------------------------------------------ position in the group
    @property
    def rank(self) -> int:
        return self._context.rank

    @property
    def world_size(self) -> int:
        return self._context.world_size

    @property
    def local_rank(self) -> int:
        return self._context.local_rank

    @property
    def local_world_size(self) -> int:
        return self._context.local_world_size

    @property
    def master_addr(self) -> str:
        return self._context.master_addr

    @property
    def master_port(self) -> int:
        return self._context.master_port

    def worker_context(self) -> dict:
        return asdict(self._context)

    # ------------------------------------------------------------------ torch.distributed and threads
    @property
    def is_distributed_initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def init_distributed(self, timeout_s: float = 600.0) -> None:
        """Join the group's process group (gloo on CPU, nccl on GPUs; see hybridflow.device). Idempotent.

        Colocated roles share one process, so the second role finds the process group initialised and reuses it.
        """
        if self.is_distributed_initialized:
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise RuntimeError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()}, "
                    f"but this worker is rank {self.rank} of {self.world_size}; one process can only join one group"
                )
            return
        if not self.master_port:
            raise RuntimeError(
                "this worker has no rendezvous port (MASTER_PORT unset): build it through a WorkerGroup, or set "
                "MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE before constructing it"
            )
        if device.is_cuda_available():
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=timeout_s)
        # rank 0's store listens on the master address only: on a loopback-only run nothing is reachable from the
        # network
        store = tcp_store(self.master_addr, self.master_port, self.world_size, self.rank == 0, timeout)
        dist.init_process_group(
            backend=device.dist_backend(), store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        self._owns_process_group = True

    def destroy_distributed(self) -> None:
        """Leave the process group this worker created (the local backend's shutdown: the driver lives on)."""
        if getattr(self, "_owns_process_group", False) and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

    def set_num_threads(self, num_threads: int) -> int:
        """Set torch's intra-op thread count in this process; returns the count now in force."""
        return device.set_num_threads(num_threads)

    def get_num_threads(self) -> int:
        return torch.get_num_threads()

    # ------------------------------------------------------------------ mesh-aware dispatch
    def register_dp_mesh(self, mesh_name: str, dp_rank: int, dp_size: int, is_collector: bool) -> None:
        """Declare this rank's data-parallel position on `mesh_name` (see hybridflow.single_controller.dispatch)."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank} (mesh {mesh_name!r}, rank {self.rank})")
        self._dp_meshes[mesh_name] = DPMeshInfo(int(dp_rank), int(dp_size), bool(is_collector))

    def get_dp_mesh(self, mesh_name: str) -> DPMeshInfo | None:
        return self._dp_meshes.get(mesh_name)
