"""Issue #22's goals in one command, on this machine: runs the scripts that measure them and prints one JSON document
with each goal's measured ratio, its limit and whether it is met.

    .venv/bin/python benchmarks/issue_22_goals.py                    # ~8 min on 2 cores (+ .venv-trl/.venv-vllm once)
    .venv/bin/python benchmarks/issue_22_goals.py --out-dir DIR      # also keeps each script's own JSON in DIR
    .venv/bin/python benchmarks/issue_22_goals.py --only step,mfu
    .venv/bin/python benchmarks/issue_22_goals.py --only demo --demo-other /tmp/before   # before and after a change

The goals, each from its script's JSON (those scripts' docstrings say how they measure):
  * ``step``: ``rl_step_vs_trl.py --quick``: the GRPO step over its model-math floor, tiny fp32 <= 3x, mid fp32 <=
    1.5x and, on CPUs with native bf16 (AVX512-BF16 or AMX), mid bf16 <= 1.5x and ahead of TRL
    (``goal_issue_22_met``); ``possible`` is false where the least step memory allows is already over the limit
    (``goal_issue_22_possible``);
  * ``rollout``: ``rollout_throughput.py --backends native,vllm,vllm:enforce_eager=false`` at batch 64 (64 prompts x
    1 sample) and in GRPO's shape (8 prompts x 8 samples), fp32 and, with native bf16, bf16: the native engine's new
    tokens/s (best of 3 calls) at least the faster vLLM mode's (eager or compiled), per dtype and shape;
  * ``mfu``: ``train_throughput.py --size mid --threads 2 --dtypes fp32``: training MFU >= 0.7 of the measured peak;
  * ``demo``: ``demo_time_to_target.py``: the main job's (``make demo``'s) wall time to its first held-out check at >=
    50% mean@4, a number to report (met: the job got there); ``--demo-other DIR`` times another checkout too, the
    "before" of a change (``before``).
Each goal is measured in one run on this machine; the CPU flags are in ``machine``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_flags, document, emit, log
from rl_step_vs_trl import ISSUE_22_LIMITS

HERE = os.path.dirname(os.path.abspath(__file__))
MFU_LIMIT = 0.7
# each engine's best of this many generate calls (rollout_throughput.py --repeats): the engines cannot alternate calls
# (vLLM's CPU thread binding keeps them out of one process), so each needs enough calls to have one outside a slower
# spell of a shared host (docs/benchmarks.md, forty-fourth session)
ROLLOUT_REPEATS = 3
GOALS = ("step", "rollout", "mfu", "demo")


def run_script(name: str, args: list[str], out_dir: str | None, label: str) -> tuple[dict | None, dict]:
    """Runs benchmarks/`name` with this interpreter (its progress on stderr); its JSON (None if it failed: the
    other goals still run), and how it ran."""
    command = [sys.executable, os.path.join(HERE, name), *args]
    log(f"{label}: {' '.join(command[1:])}")
    start = time.perf_counter()
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(HERE))
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        log(f"{label}: {name} exited with {proc.returncode} (its stderr is above); its goals count as not met")
        return None, {"command": command[1:], "seconds": seconds, "error": f"exit status {proc.returncode}"}
    doc = json.loads(proc.stdout)
    if out_dir:
        with open(os.path.join(out_dir, f"{label}.json"), "w") as f:
            f.write(proc.stdout)
    return doc, {"command": command[1:], "seconds": seconds, "git_commit": doc.get("git_commit")}


def failed(run: dict) -> dict:
    return {"met": False, "error": f"{run['command'][0]}: {run['error']}"}


def step_goals(doc: dict) -> dict:
    goals = {}
    for key, met in doc["goal_issue_22_met"].items():
        result = doc["results"][key]
        for backend, ok in met.items():
            goals[f"step_{key}_{backend}" if len(met) > 1 else f"step_{key}"] = {
                "measured": doc["step_over_floor"][key][backend],
                "limit": ISSUE_22_LIMITS[key],
                "ratio_vs_trl": result["hybridflow"][backend]["ratio_vs_trl"],
                "least_over_floor": result["model_math_floor"]["least_step"]["least_over_floor"],
                "met": ok,
                "possible": doc["goal_issue_22_possible"][key],
            }
    return goals


def rollout_goals(doc: dict, shape: str) -> dict:
    goals = {}
    for dtype in doc["config"]["dtypes"]:
        rows = [r for r in doc["results"] if r["dtype"] == dtype]
        native = next((r["new_tokens_per_s"] for r in rows if r["backend"] == "native"), None)
        vllm = {r["backend"]: r["new_tokens_per_s"] for r in rows if r["backend"].startswith("vllm")}
        if native is None or not vllm:
            goals[f"rollout_{dtype}_{shape}"] = {"met": False, "error": f"not measured: {doc.get('errors')}"}
            continue
        mode, best = max(vllm.items(), key=lambda kv: kv[1])
        goals[f"rollout_{dtype}_{shape}"] = {
            "measured": round(native / best, 2), "limit": 1.0, "native_tokens_per_s": native,
            "vllm_tokens_per_s": vllm, "against": mode, "met": native >= best,
        }
    return goals


def demo_goal(doc: dict) -> dict:
    """The main job's seconds (and step) to its first held-out check >= the target: this tree's, and with
    --demo-other the other checkout's (``before``)."""
    trees, runs = doc["config"]["trees"], doc["results"]["runs"]

    def best(tree: str) -> dict | None:
        hits = [r["to_target"] for r in runs if r["tree"] == tree and r["to_target"]]
        if not hits:
            return None
        first = min(hits, key=lambda h: h["wall_s"])
        return {**first, "wall_s": round(first["wall_s"], 1)}

    goal = {"target": doc["config"]["target"], "measured": best(trees[0]), "met": best(trees[0]) is not None}
    if len(trees) > 1:
        goal["before"] = {"tree": trees[1], **(best(trees[1]) or {"to_target": None})}
    return goal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(GOALS), help=f"comma-separated: {', '.join(GOALS)}")
    p.add_argument("--demo-other", default=None, help="demo: also time this checkout (e.g. the tree before a change)")
    p.add_argument("--out-dir", default=None, help="keep each script's JSON here (<label>.json)")
    args = p.parse_args()
    only = {g for g in args.only.split(",") if g}
    if only - set(GOALS):
        raise SystemExit(f"--only: unknown goal(s) {sorted(only - set(GOALS))}; choose from {', '.join(GOALS)}")
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    dtypes = "fp32,bf16" if cpu_flags()["native_bf16"] else "fp32"
    goals, runs = {}, {}
    if "step" in only:
        doc, runs["step"] = run_script("rl_step_vs_trl.py", ["--quick"], args.out_dir, "step")
        goals.update(step_goals(doc) if doc else {"step": failed(runs["step"])})
    if "rollout" in only:
        for shape, n in (("64x1", 1), ("8x8", 8)):
            label = f"rollout_{shape}"
            doc, runs[label] = run_script(
                "rollout_throughput.py", ["--backends", "native,vllm,vllm:enforce_eager=false", "--dtypes", dtypes,
                                          "--batch-sizes", "64", "--n", str(n), "--repeats", str(ROLLOUT_REPEATS)],
                args.out_dir, label)
            goals.update(rollout_goals(doc, shape) if doc else {label: failed(runs[label])})
    if "mfu" in only:
        doc, runs["mfu"] = run_script("train_throughput.py", ["--size", "mid", "--threads", "2", "--dtypes", "fp32"],
                                      args.out_dir, "mfu")
        if doc is None:
            goals["mfu_mid_fp32"] = failed(runs["mfu"])
        else:
            mfu = doc["results"]["fp32"]["mfu"]
            goals["mfu_mid_fp32"] = {"measured": round(mfu, 3), "limit": MFU_LIMIT, "met": mfu >= MFU_LIMIT}
    if "demo" in only:
        doc, runs["demo"] = run_script("demo_time_to_target.py",
                                       ["--other", args.demo_other] if args.demo_other else [], args.out_dir, "demo")
        goals["demo_to_50"] = demo_goal(doc) if doc else failed(runs["demo"])
    out = document("issue_22_goals", {"only": sorted(only), "dtypes": dtypes, "runs": runs}, goals)
    out["all_met"] = all(g["met"] for g in goals.values())
    out["not_met"] = sorted(k for k, g in goals.items() if not g["met"])
    emit(out)


if __name__ == "__main__":
    main()
