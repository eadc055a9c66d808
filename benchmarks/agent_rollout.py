"""Multi-turn agent rollouts: episodes/s and generated tokens/s of the agent loop over each generator; one JSON doc.

    .venv/bin/python benchmarks/agent_rollout.py                          # tiny model, 16 episodes x 4 turns
    .venv/bin/python benchmarks/agent_rollout.py --size small --episodes 32 --generators engine:native

Every episode plays a fixed-length environment (``--turns`` assistant turns, a short observation after each), and the
model's eos is unreachable, so every turn generates exactly ``--tokens-per-turn`` tokens and all generators do the
same work. Generators: ``hf-reference`` (agents.HFGenerator: one request at a time, KV cache within a turn),
``engine:<name>`` (agents.RolloutEngineGenerator over a registered rollout engine: concurrent episodes' turns batched
into one engine call; every turn re-prefills its whole context, no KV kept across turns yet).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import document, emit, log, write_benchmark_model

from hybridflow.agents import AgentLoop, AgentLoopConfig, HFGenerator, RolloutEngineGenerator
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine


class FixedTurns:
    """Answers each action with a short observation; the episode ends after `turns` steps."""

    turns = 4

    def __init__(self):
        self.step_count = 0

    def reset(self, **row):
        return f" Episode {row['episode']}: play {self.turns} rounds."

    def step(self, action):
        self.step_count += 1
        return f"round {self.step_count} scored {len(action) % 7}", 0.0, self.step_count >= self.turns, {}


def make_generator(name: str, path: str, threads: int):
    if name == "hf-reference":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return HFGenerator(model, [AutoTokenizer.from_pretrained(path).eos_token_id])
    if name.startswith("engine:"):
        engine = create_rollout_engine(name.split(":", 1)[1], path, dtype="fp32", seed=0, num_threads=threads)
        return RolloutEngineGenerator(engine)
    raise SystemExit(f"unknown generator {name!r}; use hf-reference or engine:<registered engine name>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens-per-turn", type=int, default=16)
    ap.add_argument("--generators", default="hf-reference,engine:hf,engine:native")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    FixedTurns.turns = args.turns
    from transformers import AutoTokenizer

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_benchmark_model(os.path.join(tmp, "model"), args.size, unreachable_eos=True)
        tok = AutoTokenizer.from_pretrained(path)
        cfg = AgentLoopConfig(max_assistant_turns=args.turns, max_tokens_per_turn=args.tokens_per_turn,
                              max_response_tokens=args.turns * (args.tokens_per_turn + 64))
        rows = [{"prompt": [{"role": "user", "content": "Play."}], "episode": i} for i in range(args.episodes)]
        for name in args.generators.split(","):
            gen = make_generator(name, path, args.threads)
            loop = AgentLoop(gen, tok, cfg, env_factory=FixedTurns)
            loop.run_sync(rows[:2], SamplingParams(temperature=1.0))  # warm-up
            calls_before = getattr(gen, "calls", 0)
            start = time.perf_counter()
            episodes = loop.run_sync(rows, SamplingParams(temperature=1.0))
            wall = time.perf_counter() - start
            generated = sum(e.trajectory.num_generated_tokens for e in episodes)
            results[name] = {
                "wall_s": round(wall, 3),
                "episodes_per_s": round(len(episodes) / wall, 3),
                "generated_tokens_per_s": round(generated / wall, 1),
                "generated_tokens": generated,
                "turns_per_episode": sum(e.trajectory.num_assistant_turns for e in episodes) / len(episodes),
                "engine_calls": getattr(gen, "calls", calls_before) - calls_before if hasattr(gen, "calls") else None,
            }
            log(name, results[name])
    config = {k: getattr(args, k) for k in ("size", "episodes", "turns", "tokens_per_turn", "threads")}
    emit(document("agent_rollout", config, results))


if __name__ == "__main__":
    main()
