"""Rollout (generation) engines behind one interface; see base.py for the batch layout and sampling conventions.

    engine = create_rollout_engine("native", model_path, dtype="bf16")
    out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, seed=1))
"""

from hybridflow.engines.rollout.base import RolloutEngine, SamplingParams
from hybridflow.engines.rollout.registry import (
    available_rollout_engines,
    create_rollout_engine,
    register_rollout_engine,
)

__all__ = [
    "RolloutEngine",
    "SamplingParams",
    "available_rollout_engines",
    "create_rollout_engine",
    "register_rollout_engine",
]
