"""The one place that decides which accelerator and which collective backend to use.

Everything else asks here instead of writing "cuda" or "nccl" literals, so the same code runs on
CPU + gloo (laptops, CI) and on CUDA + nccl (GPU clusters).
"""

from __future__ import annotations

import os

import torch


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
