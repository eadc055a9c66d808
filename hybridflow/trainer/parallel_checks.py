"""Start-up checks of the parallel layout: tensor-parallel rollout (``rollout.tensor_model_parallel_size``) and the
training engines' tensor / Ulysses sequence parallelism (``<role>.fsdp_config.tensor_model_parallel_size``,
``<role>.ulysses_sequence_parallel_size``).

`layout_errors` judges the rollout numbers alone (called by config_checks.config_errors); `model_layout_errors` also reads
the model's config (heads, KV heads, MLP width; called by preflight); `model_parallel_errors` checks each training
engine's sizes (the engine repeats them when it builds its mesh). Each message names the numbers and what to change.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["layout_errors", "model_layout_errors", "model_parallel_errors", "packing_errors"]

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
    if ranks < 1 or per_node < 1:
        return errors  # the rank counts themselves are refused, with their keys (config_checks.py)
    if tp > 1 and ranks % tp:
        errors.append(f"{TP_KEY}={tp} does not divide the {ranks} rollout ranks ({keys}); make the rank count a "
                      f"multiple of {tp} or pick a tensor-parallel size that divides {ranks}")
    elif tp > per_node:
        errors.append(f"{TP_KEY}={tp} is larger than the {per_node} ranks of one node (n_gpus_per_node): a "
                      f"tensor-parallel group all-reduces twice per layer and must stay inside one node; set it to at "
                      f"most {per_node}")
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


def _fsdp_sizes(cfg: Any) -> list[tuple[str, int]]:
    """(key, value) of each training engine's fsdp_config.fsdp_size, in `_roles`' order."""
    arr = cfg.actor_rollout_ref
    return [("actor_rollout_ref.actor.fsdp_config.fsdp_size", arr.actor.fsdp_config.fsdp_size),
            ("actor_rollout_ref.ref.fsdp_config.fsdp_size", arr.ref.fsdp_config.fsdp_size),
            ("critic.fsdp_config.fsdp_size", cfg.critic.fsdp_config.fsdp_size)]


def model_parallel_errors(cfg: Any) -> list[str]:
    """One line per problem: an fsdp_size that does not divide the world, sizes below 1, tp * sp not dividing the
    world, TP wider than a node, a model whose
    heads / KV heads / MLP width the sizes do not divide, LoRA with TP, SP without use_remove_padding."""
    from hybridflow.engines.tensor_parallel_train import check_tensor_parallel
    from hybridflow.engines.train_mesh import check_mesh_sizes
    from hybridflow.engines.ulysses import check_sequence_parallel

    t = cfg.trainer
    world = t.nnodes * t.n_gpus_per_node
    errors: list[str] = []
    sizes = _fsdp_sizes(cfg)
    for (key, fsdp_size), (tp_key, sp_key, tp, sp, path) in zip(sizes, _roles(cfg)):
        if fsdp_size != -1 and (fsdp_size < 1 or world % fsdp_size):
            errors.append(f"{key}={fsdp_size}: the ranks that shard one copy of the model must divide the "
                          f"{world} training ranks (trainer.nnodes*trainer.n_gpus_per_node); choose one of "
                          f"{[d for d in range(1, world + 1) if world % d == 0]}, or -1 (all of them)")
            continue
        if tp == 1 and sp == 1:
            continue
        where = f"{tp_key}={tp}, {sp_key}={sp}"
        try:
            check_mesh_sizes(world, tp, sp, fsdp_size, where=where)
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
        if sp > 1 and getattr(model, "use_sequence_packing", False):
            errors.append(f"{sp_key}={sp} does not combine with use_sequence_packing=true (sequence parallelism "
                          "splits the bucketed rows); turn one of them off")
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


def packing_errors(cfg: Any) -> list[str]:
    """use_sequence_packing on a model whose attention the packed (block-diagonal) path cannot apply: sliding
    windows or soft-capped logits. Refused at start-up rather than at the first training forward."""
    from hybridflow.engines.packing import packing_refusal

    errors = []
    for key, model in (("actor_rollout_ref.model", cfg.actor_rollout_ref.model), ("critic.model", cfg.critic.model)):
        path = getattr(model, "path", None) or cfg.actor_rollout_ref.model.path
        if not getattr(model, "use_sequence_packing", False) or not path or not os.path.isdir(path):
            continue
        from transformers import AutoConfig

        reason = packing_refusal(AutoConfig.from_pretrained(path))
        if reason:
            errors.append(f"{key}.use_sequence_packing=true: the model at {path} uses {reason}, which packed "
                          f"attention does not apply; set {key}.use_sequence_packing=false")
    return errors


def batch_invariant_errors(cfg: Any) -> list[str]:
    """actor_rollout_ref.model.batch_invariant=true: the settings under which the native rollout's fp32 log-probs
    are the training engine's bit for bit (engines/batch_invariant.py); one line per setting that breaks it."""
    arr = cfg.actor_rollout_ref
    if not arr.model.batch_invariant:
        return []
    r, m = arr.rollout, arr.model
    checks = [
        (r.name == "native", f"actor_rollout_ref.rollout.name={r.name} (the native engine's steps are the ones made "
                             "batch-invariant)"),
        (m.use_remove_padding, "actor_rollout_ref.model.use_remove_padding=false (the rollout reproduces the stripped "
                               "rows)"),
        (not m.use_sequence_packing, "actor_rollout_ref.model.use_sequence_packing=true (packed rows lay keys out "
                                     "differently)"),
        (m.lora_rank == 0, f"actor_rollout_ref.model.lora_rank={m.lora_rank} (the actor adds the adapters' product "
                           "apart from the base matmul; the rollout runs merged weights)"),
        (not r.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable=true (sessions keep their own K/V "
                                  "layout)"),
        (r.enforce_eager is not False, "actor_rollout_ref.rollout.enforce_eager=false (fixed-shape steps; "
                                       "batch-invariant ones are eager)"),
        (str(r.dtype) in ("fp32", "float32"), f"actor_rollout_ref.rollout.dtype={r.dtype} (the guarantee is for fp32)"),
        (int(r.tensor_model_parallel_size) == 1,
         f"actor_rollout_ref.rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}"),
    ]
    for role, section in (("actor", arr.actor), ("ref", arr.ref)):
        key = f"actor_rollout_ref.{role}"
        checks += [
            (section.fsdp_config.param_dtype in ("fp32", "float32"),
             f"{key}.fsdp_config.param_dtype={section.fsdp_config.param_dtype} (the guarantee is for fp32)"),
            (section.fsdp_config.tensor_model_parallel_size == 1,
             f"{key}.fsdp_config.tensor_model_parallel_size={section.fsdp_config.tensor_model_parallel_size}"),
            (section.ulysses_sequence_parallel_size == 1,
             f"{key}.ulysses_sequence_parallel_size={section.ulysses_sequence_parallel_size}"),
        ]
    return [f"actor_rollout_ref.model.batch_invariant=true does not combine with {why}; change that setting or turn "
            "batch_invariant off" for ok, why in checks if not ok]
