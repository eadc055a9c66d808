"""Start-up checks of the parallel layout: tensor-parallel rollout (``rollout.tensor_model_parallel_size``) and, where
the config has them, the training's tensor / sequence parallel sizes.

`layout_errors` judges the numbers alone (called by config.validate_config); `model_layout_errors` also reads the
model's config (heads, KV heads, MLP width; called by preflight). Each message names the numbers and what to change.
"""

from __future__ import annotations

from typing import Any

__all__ = ["layout_errors", "model_layout_errors"]

TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def _rollout_ranks(cfg: Any) -> tuple[int, int, str]:
    """(ranks of the group that generates, ranks per node, the keys that set them)."""
    arr, t = cfg.actor_rollout_ref, cfg.trainer
    if arr.hybrid_engine:
        return (t.nnodes * t.n_gpus_per_node, t.n_gpus_per_node, "trainer.nnodes*trainer.n_gpus_per_node")
    r = arr.rollout
    return (r.nnodes * r.n_gpus_per_node, r.n_gpus_per_node,
            "actor_rollout_ref.rollout.nnodes*actor_rollout_ref.rollout.n_gpus_per_node")


def layout_errors(cfg: Any) -> list[str]:
    """Tensor-parallel sizes against the rank counts: divisibility, and a TP group within one node."""
    errors: list[str] = []
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if tp < 1:
        return [f"{TP_KEY}={tp} must be >= 1 (1: every rank generates with the whole model)"]
    ranks, per_node, keys = _rollout_ranks(cfg)
    if tp > 1 and ranks % tp:
        errors.append(f"{TP_KEY}={tp} does not divide the {ranks} rollout ranks ({keys}); make the rank count a "
                      f"multiple of {tp} or pick a tensor-parallel size that divides {ranks}")
    elif tp > per_node:
        errors.append(f"{TP_KEY}={tp} is larger than the {per_node} ranks of one node (n_gpus_per_node): a "
                      f"tensor-parallel group all-reduces twice per layer and must stay inside one node; set it to at "
                      f"most {per_node}")
    # the training side (issue #20's TP/SP training); getattr: these keys exist once that work is in
    actor = cfg.actor_rollout_ref.actor
    train_tp = int(getattr(actor, "tensor_model_parallel_size", 1) or 1)
    sp = int(getattr(actor, "ulysses_sequence_parallel_size", 1) or 1)
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if train_tp * sp > 1 and world % (train_tp * sp):
        errors.append(f"the {world} training ranks (trainer.nnodes*trainer.n_gpus_per_node) do not split into "
                      f"tensor-parallel {train_tp} x sequence-parallel {sp} = {train_tp * sp} groups; make the rank "
                      "count a multiple of it or lower the sizes")
    return errors


def model_layout_errors(cfg: Any) -> list[str]:
    """The model must split over the rollout's TP ranks: attention heads, KV heads and MLP width divisible by it."""
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    path = cfg.actor_rollout_ref.model.path
    if tp <= 1 or not path:
        return []
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return []  # the model checks name an unreadable model
    if cfg.actor_rollout_ref.rollout.name == "native":
        from hybridflow.engines.rollout.tensor_parallel import tensor_parallel_errors

        try:
            return [f"{path}: {m}" for m in tensor_parallel_errors(config, tp)]
        except ValueError:
            return []  # an architecture the native engine cannot run: its model_errors say so
    errors = []
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, key, None)
        if value is not None and value % tp:
            errors.append(f"{path}: the model's {key}={value} does not split over {tp} tensor-parallel ranks; set "
                          f"{TP_KEY} to a divisor of it")
    return errors
