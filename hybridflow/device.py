"""The one place that decides which accelerator and which collective backend to use.

Everything else asks here instead of writing "cuda" or "nccl" literals, so the same code runs on
CPU + gloo (laptops, CI) and on CUDA + nccl (GPU clusters).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform

import torch

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
_TOP_PAD = 64 << 20


def is_cuda_available() -> bool:
    # HYBRIDFLOW_FORCE_CPU lets a GPU machine run the CPU code path (used by tests that compare them).
    return torch.cuda.is_available() and os.environ.get("HYBRIDFLOW_FORCE_CPU", "0") != "1"


def device_name() -> str:
    """"cuda" when a GPU is usable, else "cpu"."""
    return "cuda" if is_cuda_available() else "cpu"


def current_device() -> torch.device:
    """The device this process computes on (its local GPU, or the CPU)."""
    if is_cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dist_backend() -> str:
    """The torch.distributed backend that fits `device_name()`.

    On GPUs: nccl for device tensors plus gloo for host tensors, so that collectives on CPU-resident shards
    (FSDP2's CPUOffloadPolicy: gradient-norm reduction, full-tensor gathers) have a backend too.
    """
    return "cpu:gloo,cuda:nccl" if is_cuda_available() else "gloo"


def ray_accelerator_resource() -> str:
    """The Ray resource name that stands for one accelerator."""
    return "GPU"


def set_num_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count; Ray sets OMP_NUM_THREADS to the actor's num_cpus, which is often 1.

    Returns the count in force afterwards.
    """
    if num_threads is not None and num_threads > 0:
        torch.set_num_threads(int(num_threads))
    return torch.get_num_threads()


def synchronize() -> None:
    if is_cuda_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if is_cuda_available():
        torch.cuda.empty_cache()


@functools.cache
def keep_freed_host_memory() -> bool:
    """Where this process computes on the CPU under Linux/glibc: keep the host memory that freed tensors leave for
    the next ones instead of returning it to the kernel and faulting it in again; returns whether the settings
    took. The engines call it at start; ``HYBRIDFLOW_KEEP_FREED_MEMORY=0`` leaves glibc's defaults.

    Why: a training step allocates its activations and gradients afresh and frees them at its end. With glibc's
    defaults the blocks above its dynamic mmap threshold are mmap'd and unmapped each time, and the top of the heap
    above its trim threshold is given back: the next step faults those pages in again (the kernel zeroes each one)
    in the middle of its matmuls (docs/benchmarks-history.md, sixteenth session). Here blocks up to 32 MiB come from the
    heap and up to min(1 GiB, RAM / 16) of free heap top is kept (the resident memory of a process stays near its peak,
    as with jemalloc or tcmalloc, which PyTorch's CPU tuning guides preload for the same reason); larger blocks are
    still mmap'd.
    """
    if (is_cuda_available() or os.environ.get("HYBRIDFLOW_KEEP_FREED_MEMORY", "1") == "0"
            or platform.libc_ver()[0] != "glibc"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    trim = min(1 << 30, ram // 16)
    # the mmap threshold first: setting any of these fixes glibc's otherwise dynamic thresholds
    done = all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, trim), (_M_TOP_PAD, _TOP_PAD)))
    logger.debug("glibc malloc: mmap threshold %d, trim threshold %d, top pad %d: %s", _MMAP_THRESHOLD, trim,
                 _TOP_PAD, "set" if done else "refused")
    return done


# Linux madvise(2) advice values and the x86-64 / arm64 transparent huge page size
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
HUGE_PAGE_BYTES = 2 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return function


@functools.cache
def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages: Linux with THP "always" or "madvise" (not "never"),
    computing on the CPU; ``HYBRIDFLOW_HUGE_PAGES=0`` says no."""
    if is_cuda_available() or os.environ.get("HYBRIDFLOW_HUGE_PAGES", "1") == "0" or _madvise() is None:
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of `nbytes` whose memory starts on a 2 MiB boundary and is advised into transparent huge
    pages before anything touches it (call huge_pages_available first; a ``.view(dtype)`` of it is aligned for any).

    Why: a decode step streams every weight of the model from memory once per step; with 4 KiB pages the ~25k pages
    of a 100 MB model miss the TLB on the way, and one 2 MiB page covers what 512 of them did: plain reads of 100 MB
    went from ~26 to ~37 GB/s with huge pages on a 2-core Xeon (docs/benchmarks-history.md, twenty-first session).
    """
    size = -(-max(int(nbytes), 1) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    raw = torch.empty(size + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    buffer = raw[start : start + size]
    _advise(buffer.data_ptr(), size, _MADV_HUGEPAGE)
    return buffer[: int(nbytes)]


def collapse_huge_pages(tensor: torch.Tensor) -> bool:
    """Move the whole 2 MiB pages inside `tensor`'s memory into huge pages now (MADV_COLLAPSE, Linux 6.1+), for
    memory written before it was advised; True if the kernel did. Its contents stay as they are."""
    start = tensor.data_ptr()
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = (start + tensor.numel() * tensor.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return hi > lo and _advise(lo, hi - lo, _MADV_COLLAPSE)


def _advise(address: int, length: int, advice: int) -> bool:
    madvise = _madvise()
    if madvise is None:
        return False
    if madvise(address, length, advice) != 0:
        logger.debug("madvise(%#x, %d, %d) failed: %s", address, length, advice, os.strerror(ctypes.get_errno()))
        return False
    return True


def huge_page_state(tensor: torch.Tensor) -> dict:
    """What the kernel says of the mappings `tensor`'s memory lies in (/proc/self/smaps; zeros where it cannot be
    read): ``eligible``, whether they may hold transparent huge pages (THPeligible: advised, or THP "always"), and
    ``bytes``, how much of them does now (AnonHugePages). Huge pages are best effort: under memory pressure or
    fragmentation the kernel gives 4 KiB pages to an eligible mapping."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    state, inside = {"eligible": False, "bytes": 0}, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < end and start < hi
                elif inside and head == "AnonHugePages:":
                    state["bytes"] += int(line.split()[1]) * 1024
                elif inside and head == "THPeligible:" and lo <= start < hi:
                    state["eligible"] = line.split()[1] == "1"
    except OSError:
        pass
    return state
