"""Held-out numbers of an agent-task model outside a training run: episodes through the preset's agent loop (native
engine, one process), scored by the preset's reward function, split by whether the episode called a tool.

    python -m hybridflow.trainer.agent_eval MODEL_DIR VAL_PARQUET --preset hybridflow/config/agent_calculator_grpo.yaml

make_agent_base uses it to follow the SFT base while it trains (``--eval-every``) and to record the finished base's
numbers; the RL run's own validation (``trainer.val_before_train``) measures the same thing with the same sampling
(the preset's ``val_kwargs``), on its own seed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def agent_heldout(model_dir: str, val_file: str, preset: str, *, max_rows: int | None = None,
                  overrides: list[str] | None = None, seed: int = 0) -> dict[str, Any]:
    """Returns accuracy (mean score > 0 over all episodes), tool_call_rate (episodes with at least one tool call),
    accuracy_with_tool / accuracy_without_tool (None when no episode fell in that group), episodes and score_mean.

    Sampling follows the preset's ``actor_rollout_ref.rollout.val_kwargs`` (n samples per prompt); `max_rows`
    defaults to its ``data.val_max_samples``."""
    import torch
    from transformers import AutoTokenizer

    from hybridflow.data import RLDataLoader, RLDataset
    from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
    from hybridflow.protocol import DataProto
    from hybridflow.trainer.agent_rewards import generation_input, merge_generation
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main import build_reward_fn
    from hybridflow.workers.agent_rollout import AgentRollout

    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", *(overrides or [])], preset=preset,
                      validate=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows_wanted = max_rows or cfg.data.val_max_samples or None
    ds = RLDataset(val_file, tok, max_prompt_length=cfg.data.max_prompt_length, name="val")
    if rows_wanted:
        ds = ds.head(rows_wanted)
    batch = next(iter(RLDataLoader(ds, len(ds), shuffle=False, drop_last=False, return_raw_chat=True)))
    v = cfg.actor_rollout_ref.rollout.val_kwargs
    params = SamplingParams(n=v.n, greedy=not v.do_sample, temperature=v.temperature if v.do_sample else 1.0,
                            top_k=v.top_k, top_p=v.top_p, max_new_tokens=cfg.data.max_response_length, seed=seed)
    engine = create_rollout_engine("native", model_dir, dtype="fp32", seed=seed)
    agent = AgentRollout(cfg, engine, tok)
    gen_in = generation_input(batch, batch.select(["input_ids", "attention_mask", "position_ids"], meta_keys=[]))
    gen = agent.generate(gen_in, params)
    rows = batch.select([], non_tensor_keys=list(batch.non_tensor_batch)).repeat(v.n, interleave=True)
    rows.union(DataProto(batch=gen.batch))
    merge_generation(rows, gen)
    rows.batch["response_mask"] = rows.batch["response_mask"].float()
    reward_fn = build_reward_fn(cfg, tok)
    try:
        scores = reward_fn(rows).scores
    finally:
        reward_fn.close()  # its scoring pool (AgentRewardFn passes it to the wrapped manager)
    solved = (scores > 0).float()
    used = torch.tensor([len(c or []) > 0 for c in rows.non_tensor_batch["tool_calls"]], dtype=torch.bool)

    def mean(t: torch.Tensor) -> float | None:
        return round(float(t.mean()), 4) if len(t) else None

    return {"episodes": len(rows), "accuracy": mean(solved), "score_mean": mean(scores.float()),
            "tool_call_rate": mean(used.float()), "accuracy_with_tool": mean(solved[used]),
            "accuracy_without_tool": mean(solved[~used])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("val_file")
    p.add_argument("--preset", required=True)
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(json.dumps(agent_heldout(a.model_dir, a.val_file, a.preset, max_rows=a.max_rows, seed=a.seed), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
