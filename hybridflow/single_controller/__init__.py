"""The single controller: one driver process drives groups of SPMD workers as if each group were one object.

    class Actor(Worker):
        def __init__(self, config):
            super().__init__()                       # rank, world_size, local_rank, master_addr/port from the group
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model(self): self.init_distributed(); ...
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def compute_log_prob(self, data: DataProto) -> DataProto: ...

    pool = ResourcePool(process_on_nodes=[2])
    wg = WorkerGroup(pool, ClassWithInitArgs(Actor, config), name_prefix="actor")   # backend="ray" | "local"
    wg.init_model()                      # list of per-rank results
    out = wg.compute_log_prob(batch)     # padded, chunked, run on both ranks at once, gathered, unpadded

Where things are:
  worker.py         Worker (the base class, torch.distributed set-up, threads, dp meshes)
  dispatch.py       @register, Dispatch / Execute modes, register_dispatch_mode, mesh-aware DP dispatch
  worker_group.py   WorkerGroup (Ray and local backends), create_colocated_worker_groups
  resource_pool.py  ResourcePool (placement groups, validation, rank order)
  future.py         DataProtoFuture (non-blocking results, chunk-wise hand-over between groups)
  host.py           what runs in each rank's process; ClassWithInitArgs
  errors.py         WorkerGroupError (names group, method, rank, node, pid)

This package knows nothing about RL or language models; it imports only hybridflow.protocol and hybridflow.device.
"""

from hybridflow.single_controller.dispatch import (
    Dispatch,
    Dispatched,
    DispatchMode,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
)
from hybridflow.single_controller.errors import WorkerGroupError
from hybridflow.single_controller.future import DataProtoFuture
from hybridflow.single_controller.host import ClassWithInitArgs
from hybridflow.single_controller.resource_pool import ResourcePool
from hybridflow.single_controller.worker import DPMeshInfo, Worker
from hybridflow.single_controller.worker_group import WorkerGroup, create_colocated_worker_groups

__all__ = [
    "ClassWithInitArgs",
    "DPMeshInfo",
    "DataProtoFuture",
    "Dispatch",
    "DispatchMode",
    "Dispatched",
    "Execute",
    "ResourcePool",
    "Worker",
    "WorkerGroup",
    "WorkerGroupError",
    "create_colocated_worker_groups",
    "make_nd_compute_dataproto_dispatch_fn",
    "register",
    "register_dispatch_mode",
]
