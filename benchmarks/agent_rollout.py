"""Multi-turn agent rollouts on the tool task: episodes/s and generated tokens/s of the agent loop per generator.

    .venv/bin/python benchmarks/agent_rollout.py                          # tiny model, 16 episodes x 4 turns
    .venv/bin/python benchmarks/agent_rollout.py --size small --episodes 32 --generators engine:native,engine:native:reprefill

The workload has the shape of the calculator tool task (data/ agent tasks): a system prompt describing the
``calculator`` tool, a 3-digit multiplication question, and after each assistant turn a tool result observation
(``<tool_response>{"result": ...}</tool_response>``, optionally after ``--tool-latency-ms``). A random-init model
writes no valid tool calls, so the observations come from an environment that answers every turn like the tool;
``--turns`` assistant turns per episode, and the model's eos is unreachable, so every turn generates exactly
``--tokens-per-turn`` tokens and every generator does the same work. Generators:
  ``hf-reference``           agents.HFGenerator: one request at a time, KV cache within a turn;
  ``engine:<name>``          agents.RolloutEngineGenerator over a registered rollout engine; for ``native`` this keeps
                             each episode's K/V across turns and batches turns continuously (sessions.py);
  ``engine:<name>:reprefill`` the same with keep_kv=False: concurrent turns batched into one engine.generate call,
                             every turn re-prefilling its whole context.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import document, emit, log, write_benchmark_model

from hybridflow.agents import AgentLoop, AgentLoopConfig, HFGenerator, RolloutEngineGenerator
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine

SYSTEM = ("You can call a tool. Tools: calculator(expression: str) -> number: evaluates an arithmetic expression "
          "exactly. Call it as <tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": ...}}"
          "</tool_call> and answer with the final number.")


class CalculatorTurns:
    """Answers each turn as the calculator tool would; the episode ends after `turns` assistant turns."""

    turns = 4
    latency_s = 0.0

    def __init__(self):
        self.step_count = 0

    def reset(self, **row):
        return None

    async def step(self, action):
        self.step_count += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        result = f'<tool_response>\n{{"result": {(len(action) * 7919 + self.step_count) % 999_983}}}\n</tool_response>'
        return result, 0.0, self.step_count >= self.turns, {}


def make_generator(name: str, path: str, threads: int):
    if name == "hf-reference":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return HFGenerator(model, [AutoTokenizer.from_pretrained(path).eos_token_id])
    if name.startswith("engine:"):
        _, engine_name, *mode = name.split(":")
        if mode not in ([], ["reprefill"]):
            raise SystemExit(f"unknown generator {name!r}; use engine:<name> or engine:<name>:reprefill")
        engine = create_rollout_engine(engine_name, path, dtype="fp32", seed=0, num_threads=threads)
        return RolloutEngineGenerator(engine, keep_kv=False if mode else None)
    raise SystemExit(f"unknown generator {name!r}; use hf-reference, engine:<name> or engine:<name>:reprefill")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens-per-turn", type=int, default=16)
    ap.add_argument("--tool-latency-ms", type=float, default=0.0)
    ap.add_argument("--generators", default="hf-reference,engine:hf,engine:native:reprefill,engine:native")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per generator, alternating; the best is reported")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    CalculatorTurns.turns = args.turns
    CalculatorTurns.latency_s = args.tool_latency_ms / 1000
    from transformers import AutoTokenizer

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_benchmark_model(os.path.join(tmp, "model"), args.size, unreachable_eos=True)
        tok = AutoTokenizer.from_pretrained(path)
        cfg = AgentLoopConfig(max_assistant_turns=args.turns, max_tokens_per_turn=args.tokens_per_turn,
                              max_response_tokens=args.turns * (args.tokens_per_turn + 64))
        rows = [{"prompt": [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"What is {100 + 37 * i % 900} * {100 + 91 * i % 900}?"}]}
                for i in range(args.episodes)]
        names = args.generators.split(",")
        loops = {}
        for name in names:
            gen = make_generator(name, path, args.threads)
            loops[name] = AgentLoop(gen, tok, cfg, env_factory=CalculatorTurns)
            loops[name].run_sync(rows[:2], SamplingParams(temperature=1.0))  # warm-up
        best: dict[str, tuple] = {}
        walls: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):  # generators alternate (A B C A B C ...): load drifts hit them alike
            for name in names:
                gen = loops[name].generator
                calls_before, stats_before = getattr(gen, "calls", 0), dict(getattr(gen, "stats", {}))
                start = time.perf_counter()
                episodes = loops[name].run_sync(rows, SamplingParams(temperature=1.0))
                wall = time.perf_counter() - start
                walls[name].append(round(wall, 3))
                calls = getattr(gen, "calls", 0) - calls_before if hasattr(gen, "calls") else None
                stats = {k: v - stats_before.get(k, 0) for k, v in getattr(gen, "stats", {}).items()
                         if k != "max_running_rows"}  # this run's counts (max_running_rows is a running maximum)
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, episodes, calls, stats)
        for name in names:
            wall, episodes, calls, stats = best[name]
            generated = sum(e.trajectory.num_generated_tokens for e in episodes)
            results[name] = {
                "wall_s": round(wall, 3),
                "all_wall_s": walls[name],
                "episodes_per_s": round(len(episodes) / wall, 3),
                "generated_tokens_per_s": round(generated / wall, 1),
                "generated_tokens": generated,
                "mean_trajectory_tokens": sum(len(e.trajectory.context_ids()) for e in episodes) / len(episodes),
                "turns_per_episode": sum(e.trajectory.num_assistant_turns for e in episodes) / len(episodes),
                "engine_calls": calls,  # engine.generate calls; sessions: scheduler steps
                # sessions only: tokens prefilled vs K/V reused, evictions (engines/rollout/sessions.py)
                "session_stats": stats or None,
            }
            log(name, results[name])
    config = {k: getattr(args, k) for k in ("size", "episodes", "turns", "tokens_per_turn", "tool_latency_ms",
                                            "threads", "repeats")}
    emit(document("agent_rollout", config, results))


if __name__ == "__main__":
    main()
