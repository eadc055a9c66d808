"""What a short run costs besides its steps: processes, imports, engines, shut-down; prints one JSON document.

    .venv/bin/python benchmarks/startup_time.py                          # hybrid engine and a rollout group apart
    .venv/bin/python benchmarks/startup_time.py --other /tmp/before      # and another checkout, alternated

Each measurement is a fresh Python process (PYTHONPATH = the tree) that starts a local Ray cluster and runs a tiny
model's GRPO for --steps steps, --runs times: per run its wall time, the sum of its steps (``timing/step``) and the
rest. The first run of a process also pays for importing hybridflow's driver side and the cluster's start. Placements:
``hybrid`` (one process hosting actor and rollout) and ``separate`` (``actor_rollout_ref.hybrid_engine=false``: an
actor process and a rollout process). Trees and placements alternate round by round.

Also the floor under any of it: a fresh process importing what a worker needs (ray, torch, transformers' Qwen2 model
code), wall and CPU seconds -- on a small machine most of a short run's rest is such imports, once per process.
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
from _common import ROOT, document, emit, grpo_overrides, log, median, write_benchmark_model

PLACEMENTS = {"hybrid": (), "separate": ("actor_rollout_ref.hybrid_engine=false",
                                         "actor_rollout_ref.rollout.n_gpus_per_node=1")}

# Runs in the measured process: argv[1] is a JSON list of (overrides) per run.
_CHILD = """
import json, sys, time
t0 = time.time()
from hybridflow.single_controller.local_ray import start_local_ray
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training
start_local_ray(num_cpus=8, include_dashboard=False, log_to_driver=False)
out = {"imports_and_cluster_s": time.time() - t0, "runs": []}
for overrides in json.loads(sys.argv[1]):
    t = time.time()
    cfg = load_config(overrides)
    run_training(cfg, progress=False)
    wall = time.time() - t
    rows = [json.loads(line) for line in open(cfg.trainer.default_local_dir + "/metrics.jsonl")]
    steps = sum(r["timing/step"] for r in rows if "timing/step" in r)
    out["runs"].append({"wall_s": wall, "steps_s": steps, "rest_s": wall - steps})
print("RESULT " + json.dumps(out), flush=True)
"""

_WORKER_IMPORTS = "import ray, torch, transformers; from transformers.models.qwen2 import modeling_qwen2"


def measure(tree: str, placement: str, model: str, workdir: str, steps: int, runs: int) -> dict:
    per_run = []
    for i in range(runs):
        run_dir = os.path.join(workdir, f"{placement}-{time.time_ns()}-{i}")
        per_run.append(grpo_overrides(model_path=model, run_dir=run_dir, prompts_per_step=4, n=4,
                                      max_response_length=8, steps=steps, threads=1,
                                      extra=PLACEMENTS[placement]))
    env = {**os.environ, "PYTHONPATH": tree, "RAY_ADDRESS": ""}
    t = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(per_run)], capture_output=True, text=True,
                          env=env, cwd=tree, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree} {placement}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return {"process_wall_s": time.time() - t, **json.loads(line[len("RESULT "):])}


def worker_import_floor() -> dict:
    t = time.time()
    proc = subprocess.run([sys.executable, "-c", f"{_WORKER_IMPORTS}; import os; print(sum(os.times()[:2]))"],
                          capture_output=True, text=True, check=True, timeout=300)
    return {"wall_s": time.time() - t, "cpu_s": float(proc.stdout.split()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--placements", default="hybrid,separate", help=f"comma-separated, of {sorted(PLACEMENTS)}")
    p.add_argument("--other", help="another checkout of hybridflow to time the same way (e.g. an older commit)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--runs", type=int, default=2, help="runs per process (the first pays the imports and cluster)")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    placements = args.placements.split(",")
    unknown = sorted(set(placements) - set(PLACEMENTS))
    if unknown:
        p.error(f"--placements: unknown {unknown}; choose from {sorted(PLACEMENTS)}")
    trees = [ROOT] + ([os.path.abspath(args.other)] if args.other else [])
    results: dict = {"worker_import_floor": [], "runs": {}}
    with tempfile.TemporaryDirectory() as workdir:
        model = write_benchmark_model(os.path.join(workdir, "model"), "tiny", unreachable_eos=False)
        for rnd in range(args.rounds):
            results["worker_import_floor"].append(worker_import_floor())
            order = [(t, pl) for t in trees for pl in placements]
            for tree, placement in order if rnd % 2 == 0 else order[::-1]:
                log(f"round {rnd + 1}/{args.rounds}: {placement} in {tree}")
                key = f"{placement} @ {'this tree' if tree == ROOT else tree}"
                results["runs"].setdefault(key, []).append(measure(tree, placement, model, workdir, args.steps,
                                                                   args.runs))
    summary = {}
    for key, processes in results["runs"].items():
        later = [r["rest_s"] for proc in processes for r in proc["runs"][1:]]
        summary[key] = {"first_run_rest_s": median([proc["runs"][0]["rest_s"] for proc in processes]),
                        "later_runs_rest_s": median(later) if later else None,
                        "steps_s": median([r["steps_s"] for proc in processes for r in proc["runs"]])}
    results["summary"] = summary
    config = {"placements": placements, "rounds": args.rounds, "runs": args.runs, "steps": args.steps,
              "trees": trees, "model": "tiny (write_benchmark_model)", "shape": "4 prompts x 4 samples x 8 tokens"}
    emit(document("startup_time", config, results))


if __name__ == "__main__":
    main()
