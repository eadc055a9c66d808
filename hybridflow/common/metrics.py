"""Reducing metric dicts (per micro-batch, per rank) to one dict of floats; a device's measured matmul peak."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch


def reduce_metrics(metrics: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Each key over a list of metric dicts (e.g. one per micro-batch or rank); a key counts only where present.

    A key that names an extreme keeps it: ``..._max`` / ``..._max_abs`` reduce by max, ``..._min`` by min (the
    step's largest mismatch is the largest of its micro-batches', not their mean); every other key by the mean.
    Keys come out in order of first appearance, so equal inputs give equal (and equally ordered) outputs.
    """
    values: dict[str, list[float]] = {}
    for m in metrics:
        for k, v in m.items():
            values.setdefault(k, []).append(float(v.item() if hasattr(v, "item") else v))
    return {k: _reduce(k, vs) for k, vs in values.items()}


def _reduce(key: str, values: list[float]) -> float:
    if key.endswith(("_max", "_max_abs")):
        return max(values)
    if key.endswith("_min"):
        return min(values)
    return sum(values) / len(values)


def measure_peak_flops(
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    size: int | Sequence[int] = (512, 1024, 2048),
    repeats: int = 5,
    num_threads: int | None = None,
) -> float:
    """Measured FLOP/s of square matmuls on `device` (default: this process's device): the best over `repeats`
    runs of each size in `size`, with `num_threads` torch threads (a rank's thread count; None: as set).

    A measured peak is what the hardware really reaches for this dtype; it makes MFU honest on CPUs and GPUs whose
    datasheet number is unknown or unreachable. The best of several sizes and repeats keeps a busy moment (another
    process on the core) from lowering the peak, which would inflate the MFU. On CPU the peak is the better of
    torch.matmul's (MKL in torch's x86 wheels) and oneDNN's product on the same matrices: where MKL takes a slow path
    (it reached half of oneDNN's fp32 rate on an AMD EPYC) a torch.matmul peak alone would overstate every MFU.
    """
    return max(matmul_peaks(device, dtype, size, repeats, num_threads).values())


def matmul_peaks(
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    size: int | Sequence[int] = (512, 1024, 2048),
    repeats: int = 5,
    num_threads: int | None = None,
) -> dict[str, float]:
    """measure_peak_flops per kernel: {"torch.matmul": FLOP/s, "onednn": FLOP/s (CPU, where torch has it)}."""
    from hybridflow import device as hf_device

    dev = torch.device(device) if device is not None else hf_device.current_device()
    previous = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        rates: dict[str, float] = {}
        for n in [size] if isinstance(size, int) else size:
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
            for name, product in _products(dev, a, b).items():
                product()  # warm-up: kernel selection, allocation
                for _ in range(repeats):
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    start = time.perf_counter()
                    product()
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    rate = 2.0 * n**3 / max(time.perf_counter() - start, 1e-9)
                    rates[name] = max(rates.get(name, 0.0), rate)
        return rates
    finally:
        torch.set_num_threads(previous)


def _products(dev: torch.device, a: torch.Tensor, b: torch.Tensor) -> dict:
    """The n x n products the peak is the best of: torch.matmul, and on CPU oneDNN's where this torch has it."""
    products = {"torch.matmul": lambda: a @ b}
    if dev.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        try:  # a @ b^T: the same FLOPs
            torch.ops.mkldnn._linear_pointwise(a[:4], b, None, "none", [], "")
            products["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
        except (RuntimeError, NotImplementedError):
            pass
    return products
