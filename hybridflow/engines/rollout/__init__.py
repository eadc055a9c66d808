"""Rollout (generation) engines behind one interface; see base.py."""

from hybridflow.engines.rollout.base import RolloutEngine, SamplingParams

__all__ = ["RolloutEngine", "SamplingParams"]
