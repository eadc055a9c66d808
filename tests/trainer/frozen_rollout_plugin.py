"""A rollout engine that cannot take new weights (a frozen server, say): config validation must refuse to train with it."""

from __future__ import annotations

from hybridflow.engines.rollout import RolloutEngine


class FrozenRollout(RolloutEngine):
    SUPPORTS_WEIGHT_UPDATES = False

    def __init__(self, model_path, *, dtype="fp32", seed=0, max_model_len=None):
        self.model_path = model_path

    def generate(self, prompts, params):
        raise NotImplementedError("never built: validation refuses this engine for training")

    def update_weights(self, named_tensors):
        raise NotImplementedError("this engine serves fixed weights")
