"""Start-up checks of the training engines' model parallelism (tensor and Ulysses sequence parallel), per role.

The engine repeats the same checks when it builds its mesh; here they fail before any worker starts, naming the key.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["model_parallel_errors"]


def _roles(cfg: Any) -> list[tuple[str, str, Any, int, str | None]]:
    """(tp key, sp key, tp, sp, model path) of each training engine."""
    arr = cfg.actor_rollout_ref
    a, r, c = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"
    return [
        (f"{a}.fsdp_config.tensor_model_parallel_size", f"{a}.ulysses_sequence_parallel_size",
         arr.actor.fsdp_config.tensor_model_parallel_size, arr.actor.ulysses_sequence_parallel_size, arr.model.path),
        (f"{r}.fsdp_config.tensor_model_parallel_size", f"{r}.ulysses_sequence_parallel_size",
         arr.ref.fsdp_config.tensor_model_parallel_size, arr.ref.ulysses_sequence_parallel_size, arr.model.path),
        (f"{c}.fsdp_config.tensor_model_parallel_size", f"{c}.ulysses_sequence_parallel_size",
         cfg.critic.fsdp_config.tensor_model_parallel_size, cfg.critic.ulysses_sequence_parallel_size,
         cfg.critic.model.path or arr.model.path),
    ]


def model_parallel_errors(cfg: Any) -> list[str]:
    """One line per problem: sizes below 1, tp * sp not dividing the world, TP wider than a node, a model whose
    heads / KV heads / MLP width the sizes do not divide, LoRA with TP, SP without use_remove_padding."""
    from hybridflow.engines.tensor_parallel_train import check_tensor_parallel
    from hybridflow.engines.train_mesh import check_mesh_sizes
    from hybridflow.engines.ulysses import check_sequence_parallel

    t = cfg.trainer
    world = t.nnodes * t.n_gpus_per_node
    errors: list[str] = []
    for tp_key, sp_key, tp, sp, path in _roles(cfg):
        if tp == 1 and sp == 1:
            continue
        where = f"{tp_key}={tp}, {sp_key}={sp}"
        try:
            check_mesh_sizes(world, tp, sp, -1, where=where)
        except ValueError as err:
            errors.append(str(err))
            continue
        if tp > t.n_gpus_per_node:
            errors.append(f"{tp_key}={tp} is larger than a node (trainer.n_gpus_per_node={t.n_gpus_per_node}); "
                          "tensor-parallel ranks exchange activations every layer and must share a node")
        if tp > 1 and cfg.actor_rollout_ref.model.lora_rank > 0 and not tp_key.startswith("critic"):
            errors.append(f"{tp_key}={tp} with LoRA (actor_rollout_ref.model.lora_rank="
                          f"{cfg.actor_rollout_ref.model.lora_rank}) is not supported; use one of them")
        model = cfg.critic.model if tp_key.startswith("critic") else cfg.actor_rollout_ref.model
        if sp > 1 and not model.use_remove_padding:
            errors.append(f"{sp_key}={sp} needs use_remove_padding=true on that model (the stripped layout)")
        if path and os.path.isdir(path):  # a missing model folder is reported by the model checks
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(path)
            for check, args in ((check_tensor_parallel, (hf_config, tp, tp_key)),
                                (check_sequence_parallel, (hf_config, sp, tp, sp_key))):
                try:
                    check(*args)
                except ValueError as err:
                    errors.append(str(err))
    return errors
