"""Put + get a DataProto through a local Ray object store vs. a plain dict of torch tensors; prints one JSON document.

    python benchmarks/protocol_transfer.py [--quick] [--rows 64] [--seq 2048] [--repeats 30]

Measured: median ms of ray.put and ray.get for
  * DataProto (tensor storage pickled as numpy buffers, copied once on get -- the shipped design),
  * the same numpy buffers without that copy (what a zero-copy get would cost),
  * a dict of torch tensors (torch's own pickling: storage copied in-band),
and the "zero-copy hazard": whether writing into a tensor that aliases the store changes what later readers see.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hybridflow.protocol import DataProto, _tensor_to_numpy


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def bench(obj, repeats: int) -> dict:
    import ray

    put_ms, ref = timed(lambda: ray.put(obj), repeats)
    get_ms, _ = timed(lambda: ray.get(ref), repeats)
    return {"put_ms": round(put_ms, 3), "get_ms": round(get_ms, 3)}


def zero_copy_hazard() -> dict:
    """Write through a tensor made zero-copy from a Ray-store buffer; does the stored object change?"""
    import ray

    ref = ray.put(np.arange(100_000, dtype=np.int64))
    arr = ray.get(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable -- and then writes anyway
        aliased = torch.from_numpy(arr)
    aliased[0] = -1
    seen_later = int(ray.get(ref)[0])
    safe_ref = ray.put(DataProto.from_dict({"x": torch.arange(100_000)}))
    ray.get(safe_ref).batch["x"][0] = -1
    return {
        "store_buffer_writeable_flag": bool(arr.flags.writeable),
        "zero_copy_write_visible_to_later_get": seen_later == -1,
        "dataproto_write_visible_to_later_get": int(ray.get(safe_ref).batch["x"][0]) == -1,
    }


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    repeats = 5 if args.quick else args.repeats

    import ray

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    g = torch.Generator().manual_seed(0)
    tensors = {
        "input_ids": torch.randint(0, 50_000, (args.rows, args.seq), generator=g),
        "old_log_probs": torch.randn(args.rows, args.seq, generator=g),
    }
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    batch = DataProto.from_dict(dict(tensors))
    numpy_state = {k: _tensor_to_numpy(v) for k, v in tensors.items()}  # the buffers DataProto pickles

    results = {
        "dataproto": bench(batch, repeats),
        "numpy_buffers_zero_copy": bench(numpy_state, repeats),
        "dict_of_torch_tensors": bench(dict(tensors), repeats),
    }
    copy_ms, _ = timed(lambda: [a.copy() for a, _ in numpy_state.values()], repeats)
    results["get_side_copy_ms"] = round(copy_ms, 3)
    results["zero_copy_hazard"] = zero_copy_hazard()
    ray.shutdown()

    print(
        json.dumps(
            {
                "benchmark": "protocol_transfer",
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "versions": {"torch": torch.__version__, "ray": ray.__version__, "numpy": np.__version__},
                "git_commit": git_commit(),
                "config": {
                    "rows": args.rows,
                    "seq": args.seq,
                    "bytes": nbytes,
                    "repeats": repeats,
                    "quick": args.quick,
                },
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
