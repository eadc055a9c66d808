"""A torch.distributed backend whose collectives go through shared memory, for the training mesh's groups (FSDP's
data-parallel shards and replicas, tensor parallelism) when every rank runs on one host's CPUs.

Why: DTensor's tensor parallelism makes an all-reduce after every row-parallel projection, forward and backward; on
CPU these went through gloo over loopback TCP (0.3-1.3 ms each on a 2-core VM, docs/benchmarks.md). The rollout's
TP groups already share memory for theirs (rollout/shm_collectives.py); this backend gives the training mesh the same
segments, so that DTensor, FSDP2 and the rest of torch use them through the ordinary process-group API; FSDP2's
all-gathers and reduce-scatters over the data-parallel groups too (benchmarks/data_parallel_update.py).

`ShmProcessGroup` implements what torch's tensor-parallel training calls on a group, under the method names torch's
Python process groups answer to: all-reduce (a sum in rank order, so every rank holds the same bits; other
reductions over the gathered tensors), all-gather and reduce-scatter (lists, flat tensors, coalesced), broadcast,
scatter (DTensor's distribute_tensor), all-to-all of equal chunks and barrier. Every operation completes before it
returns (its Work is already done). `shm_backend_override` is the collective start-up choice: the backend for the
mesh's dimensions where every rank of the world shares a host and the kernel builds, else None (gloo stays).
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from hybridflow.engines.rollout import shm_collectives as shm

__all__ = ["BACKEND", "ShmProcessGroup", "register", "shm_backend_override"]

logger = logging.getLogger(__name__)

BACKEND = "hybridflow_shm"
_SUMMED = (torch.float32, torch.bfloat16)  # the dtypes the C kernel sums; others are reduced from a gather


def _op(opts):
    """The reduction's kind (a ReduceOp.RedOpType: SUM, MAX...); torch passes its options object, a direct call may
    pass none."""
    if opts is None:
        return dist.ReduceOp.SUM
    op = opts.reduceOp
    return getattr(op, "op", op)  # a ReduceOp object carries its kind in .op


def _root(opts) -> int:
    return 0 if opts is None else opts.rootRank


def _done(result) -> dist.Work:
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


_REDUCE = {
    dist.ReduceOp.SUM: lambda parts: parts.sum(0),
    dist.ReduceOp.AVG: lambda parts: parts.sum(0) / parts.shape[0],
    dist.ReduceOp.PRODUCT: lambda parts: parts.prod(0),
    dist.ReduceOp.MIN: lambda parts: parts.min(0).values,
    dist.ReduceOp.MAX: lambda parts: parts.max(0).values,
}


class ShmProcessGroup(dist.ProcessGroup):
    """A process group of `size` ranks of one host, over one shared-memory segment (shm_collectives.ShmGroup)."""

    def __init__(self, rank: int, size: int, segment: shm.ShmGroup):
        super().__init__(rank, size)
        self._rank, self._size, self.segment = rank, size, segment

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:  # torch sets it on its own process groups; a Python one answers from the registry
        return dist.distributed_c10d._world.pg_names[self]

    # ------------------------------------------------------------------ the collectives
    def _reduce(self, t: torch.Tensor, op) -> None:
        """t (any layout) reduced over the ranks, in place."""
        if op not in _REDUCE:
            raise NotImplementedError(f"{BACKEND}: reduce op {op} (SUM, AVG, PRODUCT, MIN and MAX are supported)")
        x = t.contiguous()  # t itself when it is contiguous: reduced in place
        if x.dtype in _SUMMED and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            self.segment.all_reduce(x)
            if op == dist.ReduceOp.AVG:
                x.div_(self._size)
        else:
            x = _REDUCE[op](self.segment.all_gather(x)).to(t.dtype)
        if x is not t:
            t.copy_(x)

    def allreduce(self, tensors, opts=None):
        for t in tensors:
            self._reduce(t, _op(opts))
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        for t in tensors:
            self._reduce(t, _op(opts))
        return _done(tensors)

    def allgather(self, output_lists, inputs, opts=None):
        for outs, x in zip(output_lists, inputs):
            for out, part in zip(outs, self.segment.all_gather(x.contiguous())):
                out.copy_(part)
        return _done(output_lists)

    def all_gather_single(self, output, x, opts=None):  # torch's _allgather_base / all_gather_into_tensor
        if output.is_contiguous():  # FSDP2's gather buffers are: the pieces land in place
            self.segment.all_gather(x.contiguous(), out=output)
        else:
            output.copy_(self.segment.all_gather(x.contiguous()).reshape(output.shape))
        return _done(output)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        for out, parts in zip(outputs, input_lists):
            whole = torch.stack([p.contiguous() for p in parts])
            self._reduce(whole, _op(opts))
            out.copy_(whole[self._rank])
        return _done(outputs)

    def reduce_scatter_single(self, output, x, opts=None):  # _reduce_scatter_base / reduce_scatter_tensor
        op = _op(opts)
        if x.dtype in _SUMMED and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and output.is_contiguous():
            # FSDP2's gradient reduction: each rank sums only its own piece (cpu_shm_collectives.c)
            self.segment.reduce_scatter(x.contiguous(), output)
            if op == dist.ReduceOp.AVG:
                output.div_(self._size)
            return _done(output)
        whole = x.contiguous().clone()
        self._reduce(whole, op)
        output.copy_(whole.reshape(self._size, -1)[self._rank].reshape(output.shape))
        return _done(output)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for out, x in zip(outputs, inputs):
            self.all_gather_single(out, x, opts)
        return _done(outputs)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for out, x in zip(outputs, inputs):
            self.reduce_scatter_single(out, x, opts)
        return _done(outputs)

    def broadcast(self, tensors, opts=None):
        for t in tensors:
            t.copy_(self.segment.all_gather(t.contiguous())[_root(opts)])
        return _done(tensors)

    def scatter(self, outputs, input_lists, opts=None):
        out = outputs[0]
        if self._rank == _root(opts):
            whole = torch.stack([p.contiguous() for p in input_lists[0]])
        else:  # every rank contributes a buffer of the same size; the root's is the one read
            whole = torch.zeros((self._size, *out.shape), dtype=out.dtype)
        out.copy_(self.segment.all_gather(whole)[_root(opts)][self._rank])
        return _done(outputs)

    def all_to_all_single(self, output, x, output_split_sizes, input_split_sizes, opts=None):  # alltoall_base
        if output_split_sizes or input_split_sizes:
            raise NotImplementedError(f"{BACKEND}: all-to-all with uneven splits")
        parts = self.segment.all_gather(x.contiguous())  # [size (sender), size (receiver) * chunk]
        mine = parts.reshape(self._size, self._size, -1)[:, self._rank]
        output.copy_(mine.reshape(output.shape))
        return _done(output)

    def barrier(self, opts=None):
        self.segment.all_reduce(torch.zeros(1))
        return _done(None)


def _create(store, rank: int, size: int, timeout) -> ShmProcessGroup:
    """torch.distributed's creator: the group's first rank makes the segment, the others map it (the group's store
    carries its path), then the file goes."""
    lib = shm.load()
    if lib is None:
        raise RuntimeError(f"{BACKEND}: the shared-memory kernel did not build (a C compiler is needed)")
    nbytes = shm.ShmGroup.segment_bytes(size, lib, shm.SLOT_BYTES)
    seconds = timeout.total_seconds() if timeout is not None else shm.TIMEOUT_S
    if rank == 0:
        buffer, path = shm.create_segment(nbytes)
        store.set("segment", path)
    else:
        path = store.get("segment").decode()  # waits for the first rank, up to the store's timeout
        buffer = shm.map_segment(path, nbytes)
    store.add("mapped", 1)
    if rank == 0:
        deadline = time.monotonic() + seconds
        while store.add("mapped", 0) < size:
            if time.monotonic() > deadline:
                shm.remove_segment_file(path)
                raise RuntimeError(f"{BACKEND}: the group's other ranks did not map its segment in {seconds:g} s")
            time.sleep(0.001)
        shm.remove_segment_file(path)
    return ShmProcessGroup(rank, size, shm.ShmGroup(buffer, path, size, rank, lib, shm.SLOT_BYTES, seconds))


@functools.cache
def register() -> str:
    """The backend registered with torch.distributed (once a process); its name."""
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    return BACKEND


def shm_backend_override(device_type: str, sizes: dict[str, int]) -> dict[str, str] | None:
    """{dim: BACKEND} for init_device_mesh's ``backend_override``, for each named mesh dim of more than one rank, where
    the world's ranks can share memory; else None (gloo stays). A collective over the default group: every rank calls
    it with the same sizes and gets the same answer."""
    dims = [name for name, n in sizes.items() if n > 1]
    if not dims or device_type != "cpu":
        return None
    why = shm.host_problem(torch.device(device_type), dist.get_world_size())
    if why:
        logger.info("training mesh %s: gloo's collectives (%s)", dims, why)
        return None
    return dict.fromkeys(dims, register())
