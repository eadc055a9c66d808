"""The reward stage with a reward model: veRL's legacy worker vs the reward loop (reward_model.use_reward_loop);
prints one JSON document.

    .venv/bin/python benchmarks/reward_loop_overlap.py                 # 5 steps per mode
    .venv/bin/python benchmarks/reward_loop_overlap.py --steps 8 --rule-cost-ms 20

A GRPO run on the built-in arithmetic task (a random-init "tiny" policy, 16 prompts x 4 samples, Ray backend, one
rank) whose reward is a rule score (a custom function costing --rule-cost-ms per sample, one scoring process: a
stand-in for a verifier or sandbox) plus a random-init "small" reward model (tiny.SIZES, the policy's tokenizer).
Modes: ``legacy`` (use_reward_loop=false: the model in the actor's process, scored before the rules) and
``reward_loop_hf`` (use_reward_loop=true, rollout.name=hf: the model in a process of its own, scoring while the
rules run). Per mode, medians over the steps after the first: the reward stage's seconds, ``reward/rm_wait_s``
(what was left to wait for the model once the rules were done) and the step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import StdoutToStderr, document, grpo_overrides, log, median, run_inprocess, write_benchmark_model

MODES = {
    "legacy": ["reward_model.use_reward_loop=false"],
    "reward_loop_hf": ["reward_model.use_reward_loop=true", "reward_model.rollout.name=hf"],
}
RULE_FILE = """import time

COST_S = {cost}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(COST_S)
    return float(solution_str.strip() == str(ground_truth))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rule-cost-ms", type=float, default=10.0)
    args = ap.parse_args()
    from hybridflow.engines.tiny import write_tiny_reward_model

    with tempfile.TemporaryDirectory() as work, StdoutToStderr() as out:
        policy = write_benchmark_model(os.path.join(work, "policy"), "tiny", unreachable_eos=False)
        rm = write_tiny_reward_model(os.path.join(work, "rm"), "small", seed=1, arch="qwen2")
        rule = os.path.join(work, "rule.py")
        with open(rule, "w") as f:
            f.write(RULE_FILE.format(cost=args.rule_cost_ms / 1000))
        results = {}
        for mode, keys in MODES.items():
            run_dir = os.path.join(work, mode, "run")
            os.makedirs(os.path.dirname(run_dir), exist_ok=True)
            log("mode", mode)
            rows = run_inprocess(grpo_overrides(
                model_path=policy, run_dir=run_dir, prompts_per_step=16, n=4, max_response_length=16,
                steps=args.steps, threads=1,
                extra=["reward_model.enable=true", f"reward_model.model.path={rm}", "reward_model.micro_batch_size_per_gpu=64",
                       f"custom_reward_function.path={rule}", *keys],
            ))[1:]
            results[mode] = {
                "reward_s": round(median([r["timing/reward"] for r in rows]), 4),
                "rm_wait_s": round(median([r["reward/rm_wait_s"] for r in rows]), 4) if "reward/rm_wait_s" in rows[0]
                else None,
                "step_s": round(median([r["timing/step"] for r in rows]), 4),
                "steps_counted": len(rows),
            }
        out.emit(document("reward_loop_overlap", {"steps": args.steps, "rule_cost_ms": args.rule_cost_ms,
                                                  "samples_per_step": 64, "policy": "tiny", "reward_model": "small"},
                          results))


if __name__ == "__main__":
    main()
