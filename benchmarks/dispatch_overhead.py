"""Cost of the single controller itself; prints one JSON document.

    python benchmarks/dispatch_overhead.py [--quick]

1. Round-trip latency of a no-op DP_COMPUTE_PROTO call (the worker returns its chunk) on a 2-rank group, for
   batches of 64 x 2048 and 1024 x 2048 tokens (input_ids + attention_mask, int64): pad, chunk, ship to both ranks,
   run, ship back, concat.
2. The driver's peak resident memory while a batch made on one group is handed to another group, (a) chained as a
   DataProtoFuture (the consumer ranks fetch their rows straight from the producer ranks) vs. (b) materialised in the
   driver with .get() and passed on. Peak = max RSS sampled every 2 ms during the hand-over, minus RSS before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hybridflow.protocol import DataProto
from hybridflow.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)


class NoopWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def noop(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate(self, prompts: DataProto, seq: int) -> DataProto:
        """prompts [b, 1] -> a batch of b rows of `seq` tokens made on this rank (like a rollout)."""
        n = len(prompts)
        return DataProto.from_dict(
            {
                "input_ids": torch.randint(0, 50_000, (n, seq)),
                "attention_mask": torch.ones(n, seq, dtype=torch.int64),
                "old_log_probs": torch.randn(n, seq),
            }
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def consume(self, data: DataProto) -> int:
        return int(data.batch["attention_mask"].sum())


def token_batch(rows: int, seq: int) -> DataProto:
    return DataProto.from_dict(
        {"input_ids": torch.randint(0, 50_000, (rows, seq)), "attention_mask": torch.ones(rows, seq, dtype=torch.int64)}
    )


def peak_rss_delta_mb(fn) -> tuple[float, object]:
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        stop.set()
        t.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    return (peak[0] - base) / 2**20, out


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and a smaller hand-over batch")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--handover-rows", type=int, default=2048, help="rows of the batch handed between groups")
    args = p.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc keeps freed large blocks in its heap (the mmap threshold grows after frees), which hides new
        # allocations from RSS; a fixed threshold makes every large buffer its own mapping, returned on free.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    repeats = 3 if args.quick else 20
    handover_rows = 256 if args.quick else args.handover_rows

    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    pool_a = ResourcePool([2], num_cpus_per_process=1, name="bench_a")
    pool_b = ResourcePool([2], num_cpus_per_process=1, name="bench_b")
    producer = WorkerGroup(pool_a, ClassWithInitArgs(NoopWorker), name_prefix="producer")
    consumer = WorkerGroup(pool_b, ClassWithInitArgs(NoopWorker), name_prefix="consumer")

    prompts = DataProto.from_dict({"prompt": torch.zeros(handover_rows, 1, dtype=torch.int64)})
    expected = handover_rows * args.seq
    consumer.consume(producer.generate(prompts, seq=8))  # warm-up of the hand-over path

    def chained():
        return sum(consumer.consume(producer.generate(prompts, seq=args.seq)))

    def materialised():
        batch = producer.generate(prompts, seq=args.seq).get()
        return sum(consumer.consume(batch))

    memory = {}
    for name, fn in (("chained_future", chained), ("materialised_in_driver", materialised)):
        deltas = []
        for _ in range(2 if args.quick else 3):
            delta, total = peak_rss_delta_mb(fn)
            assert total == expected, (name, total, expected)
            deltas.append(delta)
        memory[name] = {"peak_rss_delta_mb": round(max(deltas), 1)}
    handover_bytes = handover_rows * args.seq * (8 + 8 + 4)
    memory["batch_mb"] = round(handover_bytes / 2**20, 1)

    latency = {}
    for rows in (1, 64, 1024):  # 1 row: the fixed cost of a call
        batch = token_batch(rows, args.seq)
        producer.noop(batch)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = producer.noop(batch)
            times.append((time.perf_counter() - t0) * 1e3)
        assert torch.equal(out.batch["input_ids"], batch.batch["input_ids"])
        latency[f"{rows}x{args.seq}"] = {
            "median_ms": round(statistics.median(times), 3),
            "min_ms": round(min(times), 3),
            "bytes": rows * args.seq * 8 * 2,
        }

    producer.shutdown()
    consumer.shutdown()
    ray.shutdown()
    print(
        json.dumps(
            {
                "benchmark": "dispatch_overhead",
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                },
                "versions": {"torch": torch.__version__, "ray": ray.__version__},
                "git_commit": git_commit(),
                "config": {
                    "ranks": 2,
                    "seq": args.seq,
                    "repeats": repeats,
                    "handover_rows": handover_rows,
                    "quick": args.quick,
                },
                "results": {"noop_dp_compute_proto_round_trip": latency, "driver_memory_handover": memory},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
