"""`make demo`'s job (`hybridflow train`, the built-in preset) timed to its first held-out check at or above a target
mean@4, in this tree and optionally in another checkout of the project (the "before" of a change); prints one JSON
document.

    .venv/bin/python benchmarks/demo_time_to_target.py                          # this tree, target 0.5
    .venv/bin/python benchmarks/demo_time_to_target.py --other /tmp/before      # and a checkout of an older commit

Each run is the real CLI in a fresh process (`python -m hybridflow train`, run from the tree it times, with that tree
first on PYTHONPATH), validating every --test-freq steps. The wall time is taken from the process start to the moment
the metrics row that first reaches the target appears in ``metrics.jsonl`` (polled every 0.1 s), so it includes
start-up, the first validation and every later one — what a user waits. Runs of the trees alternate (A B B A ...).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, document, emit, log

VAL_KEY = "val/hybridflow/arithmetic/mean@4"


def commit_of(tree: str) -> str | None:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=tree, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def time_one(tree: str, target: float, test_freq: int, max_steps: int, run_dir: str) -> dict:
    """One `hybridflow train` of the built-in job in `tree`: seconds to the first validation >= target."""
    cmd = [sys.executable, "-m", "hybridflow", "train", f"trainer.test_freq={test_freq}",
           f"trainer.total_training_steps={max_steps}", f"trainer.default_local_dir={run_dir}", "trainer.save_freq=0",
           "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.resume_mode=disable"]
    env = {**os.environ, "PYTHONPATH": tree, "RAY_ADDRESS": "local"}
    metrics = os.path.join(run_dir, "metrics.jsonl")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen, curve, hit = 0, [], None
    try:
        while hit is None:
            done = proc.poll() is not None
            if os.path.exists(metrics):
                with open(metrics) as f:  # whole lines only: the trainer may be writing the last one
                    rows = [json.loads(line) for line in f if line.endswith("\n") and line.strip()]
                for row in rows[seen:]:
                    if VAL_KEY in row:
                        curve.append((row["step"], row[VAL_KEY], round(time.perf_counter() - start, 2)))
                        if row[VAL_KEY] >= target:
                            hit = {"step": row["step"], "wall_s": time.perf_counter() - start, "mean@4": row[VAL_KEY]}
                            break
                seen = len(rows)
            if done:
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.terminate()
        _, err = proc.communicate(timeout=60)
    if hit is None and proc.returncode not in (0, None, -15):
        raise RuntimeError(f"hybridflow train in {tree} failed (rc {proc.returncode}):\n{err[-3000:]}")
    return {"tree": tree, "commit": commit_of(tree), "to_target": hit, "val_curve": curve}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--other", help="another checkout of hybridflow to time the same way (e.g. an older commit)")
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--test-freq", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=80)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    trees = [ROOT] + ([os.path.abspath(args.other)] if args.other else [])
    runs = []
    with tempfile.TemporaryDirectory(prefix="hf-demo-time-") as work:
        for r in range(args.rounds):
            for i, tree in enumerate(trees if r % 2 == 0 else trees[::-1]):
                log(f"round {r}: {tree}")
                run = time_one(tree, args.target, args.test_freq, args.max_steps, os.path.join(work, f"{r}_{i}"))
                run["round"] = r
                runs.append(run)
                log(f"  -> {run['to_target']}")
    emit(document("demo_time_to_target", {"target": args.target, "test_freq": args.test_freq,
                                          "max_steps": args.max_steps, "rounds": args.rounds, "trees": trees},
                  {"runs": runs}))


if __name__ == "__main__":
    main()
