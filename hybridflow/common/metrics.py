"""Reducing metric dicts (per micro-batch, per rank) to one dict of floats; a device's measured matmul peak."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridflow.common.machine import cpu_description

logger = logging.getLogger(__name__)


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


def peak_flops_cache_path() -> Path | None:
    """Where machine_peak_flops keeps its measurements: ``$HYBRIDFLOW_PEAK_FLOPS_CACHE`` (a file; ``off`` keeps
    none), else ~/.cache/hybridflow/peak_flops.json."""
    setting = os.environ.get("HYBRIDFLOW_PEAK_FLOPS_CACHE")
    if setting is not None and setting.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "hybridflow" / "peak_flops.json"


def machine_peak_flops(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                       num_threads: int | None = None) -> float:
    """measure_peak_flops, measured once per machine: the value is kept in a small JSON file (peak_flops_cache_path)
    under a key naming the processor (model, flags) or GPU, torch's version, the dtype and the thread count, and
    later calls with the same key read it.

    Why: a run's MFU needs a peak, and measuring one (the driver and every training rank) cost ~2.7 s each at one
    thread on a 2-core CPU, about as long as a short run's training. The kept value is the best measured so far,
    so a busy moment during one measurement does not stay: delete the file (or set the variable to ``off``) to
    measure again.
    """
    from hybridflow import device as hf_device

    dev = torch.device(device) if device is not None else hf_device.current_device()
    path = peak_flops_cache_path()
    if path is None:
        return measure_peak_flops(dev, dtype, num_threads=num_threads)
    threads = num_threads or torch.get_num_threads()
    key = f"{_device_key(dev)}|torch {torch.__version__}|{dtype}|threads {threads}"
    kept = _read_peaks(path)
    if isinstance(kept.get(key), (int, float)) and kept[key] > 0:
        return float(kept[key])
    peak = measure_peak_flops(dev, dtype, num_threads=threads)
    kept = _read_peaks(path)  # another process may have written meanwhile: keep the best of both
    kept[key] = max(peak, float(kept.get(key) or 0.0))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            try:
                json.dump(kept, f, indent=1, sort_keys=True)
            except OSError:
                os.unlink(f.name)  # a full disk: leave no half-written temporary file behind
                raise
        os.replace(f.name, path)  # atomic: readers see the old file or the new one
    except OSError as err:
        logger.warning("could not keep the measured matmul peak in %s (%s); it will be measured again next time; set "
                       "HYBRIDFLOW_PEAK_FLOPS_CACHE to a writable file, or to off", path, err)
    return kept[key]


def _device_key(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(dev)}"
    digest = hashlib.sha256(f"{cpu_description()}|{os.cpu_count()}".encode()).hexdigest()[:16]
    return f"{dev.type} {platform.machine()} {digest}"


def _read_peaks(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measure (and rewrite it)


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
