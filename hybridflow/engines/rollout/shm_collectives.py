"""A tensor-parallel group's collectives on CPU through shared memory, where every rank of the group is on one host.

Why: on CPU, torch.distributed's collectives go through gloo, over TCP even between two processes of one machine:
an all-reduce of a decode step's hidden states takes 0.3-1.3 ms there (docs/benchmarks.md, forty-fourth session),
and a tensor-parallel decode step makes two per layer, plus the logits' all-gather and the sampled tokens'
broadcast. Here the ranks share one memory segment and a collective is a copy in, a barrier on counters in that
memory, and a sum or copy out (cpu_shm_collectives.c), microseconds at a decode step's sizes. Every rank sums the
slots in rank order, so every rank holds the same bits.

`TPCollectives` is what the tensor-parallel decoder calls: shared memory where it can be used (mode "auto": CPU
tensors, every rank of the group on this host with /dev/shm and the C kernel; "shm" requires it), torch.distributed
otherwise ("torch", and GPUs). The choice is made together (every rank learns every rank's answer), so the ranks
never disagree on the path. The segment is a file in /dev/shm that the group's first rank creates and removes as
soon as every rank has mapped it, so nothing is left behind when a process dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import socket
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.engines.rollout.c_kernels import load_library

__all__ = ["MODES", "SLOT_BYTES", "ShmGroup", "TPCollectives", "create_segment", "host_problem", "load",
           "map_segment", "remove_segment_file"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_shm_collectives.c")
MODES = ("auto", "shm", "torch")
SLOT_BYTES = 1 << 21  # a rank's slot a round: a decode step's hidden states fit one; larger tensors go in chunks
TIMEOUT_S = 600.0  # a wait longer than this raises (a peer died or hangs); the worker group's own timeout comes first
_SHM_DIR = "/dev/shm"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The C kernel, built on first use (c_kernels.py); None where it cannot be built."""
    lib = load_library(_SOURCE, "shm_collectives", "shared-memory collectives",
                       "tensor-parallel ranks keep torch.distributed's collectives", fast_math=False)
    if lib is None:
        return None
    ptr, long, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_double
    lib.shm_all_reduce.argtypes = [ptr, i, i, long, ctypes.c_longlong, ptr, long, i, f]
    lib.shm_all_reduce.restype = ctypes.c_longlong
    lib.shm_all_gather.argtypes = [ptr, i, i, long, ctypes.c_longlong, ptr, long, ptr, f]
    lib.shm_all_gather.restype = ctypes.c_longlong
    lib.shm_reduce_scatter.argtypes = [ptr, i, i, long, ctypes.c_longlong, ptr, long, i, ptr, f]
    lib.shm_reduce_scatter.restype = ctypes.c_longlong
    lib.shm_max_ranks.restype = i
    lib.shm_header_bytes.restype = long
    return lib


def _host_id() -> str:
    """This machine, as the ranks compare it: the host name and the running kernel's boot id."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def host_problem(device: torch.device, size: int, group=None) -> str:
    """Why `size` ranks of `group` (collective over it) cannot share memory for their collectives, or "": every rank
    answers the same (its own checks: a CPU device, the kernel built, /dev/shm writable, and not switched off with
    the environment variable HYBRIDFLOW_SHM_COLLECTIVES=0; together: one host)."""
    lib = load() if device.type == "cpu" else None
    if os.environ.get("HYBRIDFLOW_SHM_COLLECTIVES", "1") == "0":
        mine = "HYBRIDFLOW_SHM_COLLECTIVES=0"
    elif device.type != "cpu":
        mine = f"the tensors are on {device.type}"
    elif lib is None:
        mine = "the C kernel did not build"
    elif size > lib.shm_max_ranks():
        mine = f"{size} ranks, more than {lib.shm_max_ranks()}"
    elif not os.access(_SHM_DIR, os.W_OK):
        mine = f"{_SHM_DIR} is not writable"
    else:
        mine = ""
    answers: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(answers, (_host_id(), mine), group=group)
    problems = [f"rank {r}: {why}" for r, (_, why) in enumerate(answers) if why]
    if len({host for host, _ in answers}) > 1:
        problems.append("the ranks are on more than one host")
    return "; ".join(problems)


class ShmGroup:
    """One mapped segment shared by the `size` ranks of a group (its file, `path`, already removed); this process is
    rank `rank` of it."""

    def __init__(self, buffer: mmap.mmap, path: str, size: int, rank: int, lib: ctypes.CDLL, slot_bytes: int,
                 timeout_s: float):
        self.buffer, self.path, self.size, self.rank, self.lib = buffer, path, size, rank, lib
        self.slot, self.timeout_s = slot_bytes, timeout_s
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        self.round = 1  # every rank counts the same rounds

    @staticmethod
    def segment_bytes(size: int, lib: ctypes.CDLL, slot_bytes: int) -> int:
        return int(lib.shm_header_bytes()) + 2 * size * slot_bytes

    def _advance(self, result: int, what: str) -> None:
        if result < 0:
            raise RuntimeError(f"tensor-parallel {what} in shared memory: rank {self.rank} of {self.size} waited "
                               f"{self.timeout_s:g} s for its peers; one of them died or hangs")
        self.round = result

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous CPU fp32 or bf16) summed over the ranks, in place; x itself."""
        self._advance(self.lib.shm_all_reduce(self.base, self.size, self.rank, self.slot, self.round, x.data_ptr(),
                                              x.numel(), int(x.dtype == torch.bfloat16), self.timeout_s), "all-reduce")
        return x

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[size, *x.shape]: every rank's x (contiguous CPU tensors of one shape and dtype on every rank), written into
        `out` when given (contiguous, x's dtype, size * x.numel() elements, any shape)."""
        if out is None:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype)
        elif not (out.is_contiguous() and out.dtype == x.dtype and out.numel() == self.size * x.numel()):
            raise ValueError(f"all-gather into {tuple(out.shape)} {out.dtype}: needs {self.size} x {x.numel()} "
                             f"contiguous {x.dtype} elements")
        nbytes = x.numel() * x.element_size()
        self._advance(self.lib.shm_all_gather(self.base, self.size, self.rank, self.slot, self.round, x.data_ptr(),
                                              nbytes, out.data_ptr(), self.timeout_s), "all-gather")
        return out

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = the sum over the ranks (in rank order) of their x's piece number `rank`: x contiguous fp32 or bf16 of
        size * out.numel() elements, out contiguous of x's dtype; x is not changed."""
        m = out.numel()
        if not (x.is_contiguous() and out.is_contiguous() and x.dtype == out.dtype and x.numel() == self.size * m):
            raise ValueError(f"reduce-scatter of {tuple(x.shape)} {x.dtype} into {tuple(out.shape)} {out.dtype}: "
                             f"needs contiguous tensors of one dtype, the input {self.size} times the output")
        self._advance(self.lib.shm_reduce_scatter(self.base, self.size, self.rank, self.slot, self.round, x.data_ptr(),
                                                  m, int(x.dtype == torch.bfloat16), out.data_ptr(), self.timeout_s),
                      "reduce-scatter")
        return out


def create_segment(nbytes: int) -> tuple[mmap.mmap, str]:
    """A new zero-filled segment of `nbytes` (every counter at round 0): its mapping and its file's path."""
    path = os.path.join(_SHM_DIR, f"hybridflow-tp-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes), path
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def map_segment(path: str, nbytes: int) -> mmap.mmap:
    """Another rank's segment, mapped here; OSError when it is not there or not `nbytes` long."""
    fd = os.open(path, os.O_RDWR)
    try:
        size_now = os.fstat(fd).st_size
        if size_now != nbytes:
            raise OSError(f"{path} is {size_now} bytes, not {nbytes}")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def remove_segment_file(path: str) -> None:
    """Once every rank has mapped the segment (or given up): the memory lives until the last one unmaps it."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def _open_segment(group, size: int, rank: int, src: int, lib: ctypes.CDLL, slot_bytes: int,
                  timeout_s: float) -> tuple[ShmGroup | None, str]:
    """The group's segment, created by its first rank and then mapped by the others (collective); (None, why) on
    every rank if any rank could not map it."""
    nbytes = ShmGroup.segment_bytes(size, lib, slot_bytes)
    path, buffer, problem = "", None, ""
    if rank == 0:
        try:
            buffer, path = create_segment(nbytes)
        except OSError as err:
            problem = f"{_SHM_DIR}: {err}"
    shared = [path, problem]
    dist.broadcast_object_list(shared, src=src, group=group)  # sent once the file exists
    path, first_problem = shared
    if rank != 0 and not first_problem:
        try:
            buffer = map_segment(path, nbytes)
        except OSError as err:
            problem = str(err)
    answers: list = [None] * size
    dist.all_gather_object(answers, problem, group=group)
    if rank == 0 and not first_problem:
        remove_segment_file(path)
    failed = [f"rank {r}: {a}" for r, a in enumerate(answers) if a]
    if failed:
        if buffer is not None:
            buffer.close()
        return None, "; ".join(failed)
    return ShmGroup(buffer, path, size, rank, lib, slot_bytes, timeout_s), ""


class TPCollectives:
    """The collectives of tensor-parallel group `tp` (its .group, .size, .rank and .src, the global rank of its first
    rank): in shared memory (ShmGroup) where `mode` and the group allow it, else torch.distributed's. Collective to
    build: every rank of the group builds it at the same point. `slot_bytes` and `timeout_s` are the segment's (tests
    make them small)."""

    def __init__(self, tp, device: torch.device | str, mode: str = "auto", *, slot_bytes: int = SLOT_BYTES,
                 timeout_s: float = TIMEOUT_S):
        if mode not in MODES:
            raise ValueError(f"native rollout: tp_collectives={mode!r}; choose one of {list(MODES)}")
        if slot_bytes < 64 or slot_bytes % 64:
            raise ValueError(f"shared-memory collectives: slot_bytes={slot_bytes}; give a positive multiple of 64")
        self.tp, self.shm = tp, None
        if mode != "torch":
            self.shm, why = self._shared_memory(tp, torch.device(device), slot_bytes, timeout_s)
            if self.shm is None:
                if mode == "shm":
                    raise RuntimeError(f"native rollout: tp_collectives='shm' cannot be used here: {why}; set "
                                       "actor_rollout_ref.rollout.engine_kwargs.tp_collectives=auto (or torch)")
                logger.info("tensor-parallel rollout: torch.distributed's collectives (%s)", why)

    @staticmethod
    def _shared_memory(tp, device: torch.device, slot_bytes: int, timeout_s: float) -> tuple[ShmGroup | None, str]:
        why = host_problem(device, tp.size, tp.group)
        if why:
            return None, why
        return _open_segment(tp.group, tp.size, tp.rank, tp.src, load(), slot_bytes, timeout_s)

    @property
    def kind(self) -> str:
        return "shm" if self.shm is not None else "torch"

    def _in_shm(self, x: torch.Tensor) -> bool:
        return self.shm is not None and x.device.type == "cpu" and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group's ranks, in place; x itself."""
        if self._in_shm(x) and x.dtype in (torch.float32, torch.bfloat16):
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.tp.group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (one shape and dtype on every rank), in rank order."""
        x = x.contiguous()
        if self._in_shm(x):
            return list(self.shm.all_gather(x).unbind(0))
        parts = [torch.empty_like(x) for _ in range(self.tp.size)]
        dist.all_gather(parts, x, group=self.tp.group)
        return parts

    def from_first_rank(self, x: torch.Tensor) -> torch.Tensor:
        """The group's first rank's x, on every rank (x of one shape and dtype on every rank)."""
        x = x.contiguous()
        if self._in_shm(x):
            return self.shm.all_gather(x)[0]
        dist.broadcast(x, src=self.tp.src, group=self.tp.group)
        return x
