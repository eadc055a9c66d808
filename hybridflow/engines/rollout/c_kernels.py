"""Building and loading the native rollout's C kernels (cpu_attention.py, cpu_linear.py) on first use.

A kernel's C file is compiled once per machine with the system C compiler (``$CC``, else gcc or cc) for this CPU
(-march=native) with OpenMP, into ``$HYBRIDFLOW_KERNEL_CACHE`` (default ~/.cache/hybridflow/kernels), under a name
that hashes the source, the flags, the compiler and the CPU flags; later processes load the cached library. Without
a compiler, or when the build fails, `load_library` logs why once and returns None, and the caller keeps torch's
path. A library is loaded after torch, so its OpenMP calls run on torch's OpenMP runtime and thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from hybridflow.common.machine import cpu_description

__all__ = ["load_library", "torch_vector_function"]

logger = logging.getLogger(__name__)

# -ffast-math for the vectorised expf/tanhf; it is not passed when linking, so the library does not switch the
# process to flush-to-zero (which linking crtfastmath would)
_COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
_LINK = ["-shared", "-fopenmp"]
_LIBS = ["-lm"]


def _cache_dir() -> Path:
    path = Path(os.environ.get("HYBRIDFLOW_KERNEL_CACHE") or Path.home() / ".cache" / "hybridflow" / "kernels")
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        fallback = Path(tempfile.gettempdir()) / "hybridflow-kernels"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _build(compiler: str, source: Path, stem: str, compile_flags: list[str]) -> Path:
    """Compile `source` (or find it built); returns the shared library's path. Raises RuntimeError with the
    compiler's output when the build fails."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(compile_flags + _LINK).encode(), version.encode(),
                                     cpu_description().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"{stem}-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        obj, lib = Path(work) / "kernel.o", Path(work) / "kernel.so"
        for command in ([compiler, *compile_flags, str(source), "-o", str(obj)],
                        [compiler, *_LINK, str(obj), "-o", str(lib), *_LIBS]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(command)}` failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(lib, target)  # atomic: a process building at the same time ends with the same file
    return target


def load_library(source: Path, stem: str, what: str, fallback: str, fast_math: bool = True,
                 extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from `source` (cached as `stem`-<hash>.so), or None with a warning naming `what` the kernel
    is and the `fallback` that runs instead. fast_math=False compiles without -ffast-math; `extra_flags` are added
    to the compiler's (tests build the AVX2 variant on an AVX-512 CPU with ``-mno-avx512f``)."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        logger.warning("native rollout: no C compiler (gcc or cc) on PATH, so the CPU %s kernel is not built and %s; "
                       "install one (Debian: apt-get install gcc) or set CC", what, fallback)
        return None
    flags = [f for f in _COMPILE if fast_math or f != "-ffast-math"] + list(extra_flags)
    try:
        return ctypes.CDLL(str(_build(compiler, source, stem, flags)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        logger.warning("native rollout: building the CPU %s kernel with %s failed, so %s: %s", what, compiler,
                       fallback, err)
        return None


@functools.cache
def torch_vector_function(name: str) -> tuple[int, int] | None:
    """(address, width) of the vector `name` ("exp" or "tanh") torch's fp32 elementwise kernels call here (Sleef's, in
    libtorch_cpu), for the CPU capability torch dispatches to (16 floats with AVX-512, 8 with AVX2); None where it is
    not found."""
    width = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if width is None or not path.exists():
        return None
    try:
        function = getattr(ctypes.CDLL(os.fspath(path)), f"Sleef_{name}f{width}_u10")
    except (OSError, AttributeError):
        return None
    return ctypes.cast(function, ctypes.c_void_p).value, width
