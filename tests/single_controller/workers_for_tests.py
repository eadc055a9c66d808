"""Worker classes used by the single-controller tests (shipped to Ray workers by value, see `ship_by_value`)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from hybridflow.protocol import DataProto
from hybridflow.single_controller import (
    Dispatch,
    Execute,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
)


def ship_by_value() -> None:
    """pytest's test modules are not importable inside Ray workers: pickle this module's classes by value."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# A user-registered mode: rank i gets the i-th element of a string; results joined back into one string.
def _dispatch_letters(group, word: str):
    return [(word[i],) for i in range(group.world_size)], [{} for _ in range(group.world_size)]


def _collect_letters(group, outputs):
    return "".join(outputs)


register_dispatch_mode("LETTERS", _dispatch_letters, _collect_letters)


class EchoWorker(Worker):
    """Methods that expose what each rank received."""

    def __init__(self, offset: float = 0.0):
        super().__init__()
        self.offset = offset
        self.calls = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "master": (self.master_addr, self.master_port),
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def count_call(self) -> int:
        self.calls += 1
        return self.rank * 100 + self.calls

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO_ONLY)
    def count_call_rank_zero_only(self) -> int:
        self.calls += 1
        return self.rank * 100 + self.calls

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_calls(self) -> int:
        return self.calls

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def echo(self, *args, **kwargs):
        return self.rank, args, kwargs

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def scale(self, x: int, factor: int = 1) -> int:
        return x * factor + self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_offset(self, data: DataProto) -> DataProto:
        """values [batch] -> values + offset, and which rank saw each row."""
        out = DataProto.from_dict(
            {"values": data.batch["values"] + self.offset, "seen_by": torch.full((len(data),), self.rank)},
            {"uid": data.non_tensor_batch["uid"]},
        )
        out.meta_info["rows_on_rank"] = len(data)
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def repeat_rows(self, data: DataProto, n: int) -> DataProto:
        """Like generation with n samples: row i*n+j is sample j of input row i."""
        return data.repeat(n, interleave=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def add_offset_async(self, data: DataProto) -> DataProto:
        return self.add_offset(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def slow_add_offset_async(self, data: DataProto) -> DataProto:
        time.sleep(0.5)
        return self.add_offset(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def fail_async(self, data: DataProto) -> DataProto:
        raise ValueError(f"deliberate failure on rank {self.rank}")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def row_sum(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": len(data), "sum": float(data.batch["values"].sum())}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def rows_and_pid(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(
            {"pid": torch.full((len(data),), os.getpid())}, {"uid": data.non_tensor_batch["uid"]}
        )

    @register(dispatch_mode="LETTERS")
    def upper(self, letter: str) -> str:
        return letter.upper() if self.rank % 2 == 0 else letter

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep_on(self, rank: int, seconds: float) -> int:
        if self.rank == rank:
            time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def raise_on(self, rank: int) -> int:
        if self.rank == rank:
            raise KeyError(f"boom on rank {rank}")
        return self.rank

    def not_registered(self, x):
        return (self.rank, x)


class CollectiveWorker(Worker):
    """Joins torch.distributed and all-reduces."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> bool:
        self.init_distributed(timeout_s=60)
        return self.is_distributed_initialized

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> dict:
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        import ray

        return {"sum": float(t.item()), "node_id": ray.get_runtime_context().get_node_id(), "rank": self.rank}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_value(self, value: float) -> float:
        t = torch.tensor([value])
        dist.all_reduce(t)
        return float(t.item())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_then_sleep(self, rank_to_hang: int) -> float:
        t = torch.ones(1)
        dist.all_reduce(t)
        if self.rank == rank_to_hang:
            time.sleep(3600)
        return float(t.item())


class TensorParallelWorker(Worker):
    """4 ranks as dp=2 x tp=2: tp peers must see the same chunk; only tp rank 0 collects."""

    TP = 2

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.register_dp_mesh(
            "actor",
            dp_rank=self.rank // self.TP,
            dp_size=self.world_size // self.TP,
            is_collector=self.rank % self.TP == 0,
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="actor")
    def compute(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(
            {"values": data.batch["values"] * 10, "seen_by": torch.full((len(data),), self.rank)},
            {"uid": data.non_tensor_batch["uid"]},
        )

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor", collect="list"))
    def chunk_uids(self, data: DataProto) -> list:
        return [self.rank, *data.non_tensor_batch["uid"]]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def last_chunk_uids(self) -> list:
        return self._last

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep_on(self, rank: int, seconds: float) -> int:
        if self.rank == rank:
            time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC, mesh_name="actor")
    def record(self, data: DataProto) -> list:
        self._last = list(data.non_tensor_batch["uid"])
        return [self.rank, *self._last]


class RefWorker(Worker):
    """A second role for colocation tests."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def scaled(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"values": data.batch["values"] * self.scale}, {"uid": data.non_tensor_batch["uid"]})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rank_and_dist(self) -> tuple:
        return self.rank, self.is_distributed_initialized


class PoisonOnDriver:
    """Unpickling this object in the driver process raises: proves a batch never passed through the driver."""

    def __init__(self, driver_pid: int):
        self.driver_pid = driver_pid

    def __reduce__(self):
        return (_unpickle_poison, (self.driver_pid,))


def _unpickle_poison(driver_pid: int) -> PoisonOnDriver:
    if os.getpid() == driver_pid:
        raise RuntimeError("a poisoned batch was deserialised in the driver")
    return PoisonOnDriver(driver_pid)


class ProducerWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, data: DataProto, driver_pid: int) -> DataProto:
        out = data.select(["values"], ["uid"])
        out.non_tensor_batch["poison"] = _object_column([PoisonOnDriver(driver_pid)] * len(data))
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


def _object_column(values: list):
    import numpy as np

    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


class BrokenInitWorker(Worker):
    def __init__(self):
        super().__init__()
        raise FileNotFoundError("no checkpoint at /nowhere")


class ForgetsSuperWorker(Worker):
    def __init__(self):
        self.x = 1


class ClashingWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shutdown(self):
        return None
