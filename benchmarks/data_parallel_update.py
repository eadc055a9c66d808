"""A data-parallel (FSDP2) update on two ranks of one CPU host: FSDP's collectives in shared memory against gloo.

Two ranks (processes of their own, torch.distributed, no Ray) hold the actor (hybridflow's FSDPEngine) sharded over
both. Per model size and per mode, in alternating rounds so that a slow spell of the host hits both modes alike:
  * ``shm``   the FSDP mesh's group on the ``hybridflow_shm`` backend (engines/shm_process_group.py; the default
              where the ranks share a CPU host);
  * ``gloo``  ``HYBRIDFLOW_SHM_COLLECTIVES=0``: gloo over loopback TCP.
Timed per round: one ``train_step`` of --rows rows (each rank its half; prompts --prompt-len, responses up to
--response-len tokens, lengths varying 4x) and one ``full_state_dict`` (every parameter gathered, as the weight
sync to the rollout does); then the collectives alone at the whole model's size (fp32): one all-gather, as FSDP2's
forward and backward make, and one reduce-scatter, as its gradients take. Reported: the medians over the rounds
after the first of each, the shm/gloo ratios, and whether both modes trained the very same weights (they must: the
sums run in rank order either way).

    .venv/bin/python benchmarks/data_parallel_update.py                         # small,mid; one JSON document
    .venv/bin/python benchmarks/data_parallel_update.py --sizes mid --rounds 5 --out RESULT.json
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import document, emit, run_ranks, write_benchmark_model  # noqa: E402
from benchmarks.train_throughput import pg_loss, rollout_batch  # noqa: E402

WORLD = 2
MODES = ("shm", "gloo")


def _rank_main(rank: int, port: int, model_path: str, mode: str, args, queue) -> None:
    if mode == "gloo":
        os.environ["HYBRIDFLOW_SHM_COLLECTIVES"] = "0"
    import torch
    import torch.distributed as dist

    from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    engine = FSDPEngine(EngineConfig(model_path=model_path, optim=OptimConfig(lr=1e-5), use_dynamic_bsz=True,
                                     max_tokens_per_micro_batch=args.max_tokens))
    backend = dist.get_backend(engine.mesh.get_group())
    data = rollout_batch(args.rows, args.prompt_len, args.response_len, seed=0)
    per = args.rows // WORLD
    shard = data[rank * per : (rank + 1) * per]
    steps, gathers = [], []
    for _ in range(args.steps):
        dist.barrier()
        t = time.perf_counter()
        engine.train_step(shard, pg_loss)
        dist.barrier()
        steps.append(time.perf_counter() - t)
        t = time.perf_counter()
        state = engine.full_state_dict()
        dist.barrier()
        gathers.append(time.perf_counter() - t)
    # the collectives alone, at the whole model's size: one all-gather (FSDP2's forward / backward) and one
    # reduce-scatter (its gradients), fp32, on the group FSDP uses
    group, numel = engine.mesh.get_group(), sum(t.numel() for t in state.values())
    piece = torch.randn(numel // WORLD)
    gathered, whole, reduced = torch.empty(piece.numel() * WORLD), torch.randn(piece.numel() * WORLD), torch.empty_like(piece)
    collectives = {"all_gather_s": [], "reduce_scatter_s": [], "bytes": gathered.numel() * 4}
    for _ in range(args.steps):
        dist.barrier()
        t = time.perf_counter()
        dist.all_gather_into_tensor(gathered, piece, group=group)
        collectives["all_gather_s"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        dist.reduce_scatter_tensor(reduced, whole, group=group)
        collectives["reduce_scatter_s"].append(time.perf_counter() - t)
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(state[name].contiguous().view(torch.uint8).numpy().tobytes())
    queue.put((rank, {"backend": backend, "step_s": steps, "gather_s": gathers, "weights_sha256": digest.hexdigest(),
                      "collectives": collectives}))
    dist.destroy_process_group()


def _round(path: str, mode: str, args) -> dict:
    return run_ranks(_rank_main, WORLD, path, mode, args)[0]


def run_size(size: str, args, workdir: str) -> dict:
    path = write_benchmark_model(os.path.join(workdir, size), size, unreachable_eos=True)
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(args.rounds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            print(f"[data_parallel_update] {size} round {i + 1} {mode}", file=sys.stderr, flush=True)
            rounds[mode].append(_round(path, mode, args))
    out: dict = {}
    for mode, runs in rounds.items():
        # the first step of each run warms up (allocations, oneDNN's first calls); the rest are kept
        out[mode] = {
            "backend": runs[0]["backend"],
            "step_s": statistics.median(s for r in runs for s in r["step_s"][1:]),
            "gather_s": statistics.median(s for r in runs for s in r["gather_s"][1:]),
            "weights_sha256": sorted({r["weights_sha256"] for r in runs}),
            "model_bytes_fp32": runs[0]["collectives"]["bytes"],
            "all_gather_s": statistics.median(s for r in runs for s in r["collectives"]["all_gather_s"][1:]),
            "reduce_scatter_s": statistics.median(s for r in runs for s in r["collectives"]["reduce_scatter_s"][1:]),
        }
    out["step_ratio_shm_over_gloo"] = round(out["shm"]["step_s"] / out["gloo"]["step_s"], 3)
    out["gather_ratio_shm_over_gloo"] = round(out["shm"]["gather_s"] / out["gloo"]["gather_s"], 3)
    out["same_weights"] = out["shm"]["weights_sha256"] == out["gloo"]["weights_sha256"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small,mid")
    ap.add_argument("--rounds", type=int, default=3, help="runs per mode, alternating")
    ap.add_argument("--steps", type=int, default=4, help="update steps per run (the first is a warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=4096, help="token budget of a micro-batch")
    ap.add_argument("--out", default=None, help="also write the JSON document here")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for size in args.sizes.split(","):
            results[size] = run_size(size, args, workdir)
    emit(document("data_parallel_update", {**vars(args), "world": WORLD, "modes": list(MODES)}, results), args.out)


if __name__ == "__main__":
    main()
