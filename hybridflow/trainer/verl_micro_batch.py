"""veRL's deprecated *global* micro-batch keys, turned into hybridflow's per-rank ones once the rank count is known.

veRL still reads ``actor_rollout_ref.actor.ppo_micro_batch_size``, ``rollout.log_prob_micro_batch_size``,
``ref.log_prob_micro_batch_size``, ``critic.ppo_micro_batch_size`` and its SFT trainer's ``data.micro_batch_size``:
rows per forward summed over the data-parallel ranks of that role. Its workers divide them by the role's
data-parallel size (ranks / (tensor-parallel * sequence-parallel size)) into the ``*_per_gpu`` key. Here the same
division happens when the config is merged (`merge_overrides`), after every key is in, so the rank count is the final
one:

    trainer.n_gpus_per_node=4 actor_rollout_ref.actor.ppo_micro_batch_size=16
        -> actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 16 // 4 = 4

A global size the data-parallel ranks do not divide, or a global key beside its per-rank key with another value, is a
ConfigError naming both keys and the numbers. ``null`` (veRL's default) leaves the per-rank key as it is.
"""

from __future__ import annotations

from typing import Any

# veRL's global key -> (hybridflow's per-rank key, the section whose ranks share it: "actor", "ref", "critic", "sft")
GLOBAL_MICRO_BATCH: dict[str, tuple[str, str]] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor"),
    # the old-log-prob pass runs on the actor's engine, so the actor's data-parallel ranks share it
    "actor_rollout_ref.rollout.log_prob_micro_batch_size":
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "actor"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "ref"),
    "critic.ppo_micro_batch_size": ("critic.ppo_micro_batch_size_per_gpu", "critic"),
    "critic.forward_micro_batch_size": ("critic.forward_micro_batch_size_per_gpu", "critic"),
    "data.micro_batch_size": ("data.micro_batch_size_per_gpu", "sft"),  # `hybridflow sft` only (its schema's key)
}


def per_rank_key(key: str, known: frozenset[str] | set[str]) -> str | None:
    """The per-rank key a global micro-batch key becomes in a schema whose keys are `known`, or None."""
    target = GLOBAL_MICRO_BATCH.get(key)
    return target[0] if target is not None and target[0] in known else None


def _select(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _assign(cfg: Any, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    setattr(_select(cfg, ".".join(parents)) if parents else cfg, leaf, value)


def data_parallel_size(cfg: Any, section: str) -> tuple[int, str]:
    """(data-parallel ranks of `section`, how that number is made, in keys)."""
    t = cfg.trainer
    world = t.nnodes * t.n_gpus_per_node
    ranks = "trainer.nnodes*trainer.n_gpus_per_node"
    if section == "sft":
        return world, ranks
    if section == "critic":
        tp, sp, prefix = (cfg.critic.fsdp_config.tensor_model_parallel_size, cfg.critic.ulysses_sequence_parallel_size,
                          "critic")
    else:
        role = getattr(cfg.actor_rollout_ref, section)
        tp, sp = role.fsdp_config.tensor_model_parallel_size, role.ulysses_sequence_parallel_size
        prefix = f"actor_rollout_ref.{section}"
    if tp * sp == 1:
        return world, ranks
    return max(world // (tp * sp), 1), (f"{ranks} / ({prefix}.fsdp_config.tensor_model_parallel_size * "
                                       f"{prefix}.ulysses_sequence_parallel_size)")


def apply_global_micro_batches(cfg: Any, given: dict[str, Any], explicitly_set: set[str]) -> list[str]:
    """Write each global key's per-rank value into `cfg` (in place); returns the problems, one line each.

    `given`: global key -> value as the user wrote it; `explicitly_set`: every key the user set (files and command
    line), to tell a per-rank key the user chose from its default.
    """
    errors = []
    for key, value in given.items():
        if value is None:  # veRL's default: not set
            continue
        per_rank, section = GLOBAL_MICRO_BATCH[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            errors.append(f"{key}={value!r} must be a positive number of rows (summed over the ranks), or null")
            continue
        dp, how = data_parallel_size(cfg, section)
        if value % dp:
            errors.append(f"{key}={value} (rows per forward summed over the ranks) does not split over the {dp} "
                          f"data-parallel ranks ({how}); give a multiple of {dp}, or set {per_rank} (rows on one "
                          "rank) instead")
            continue
        converted = value // dp
        if per_rank in explicitly_set and _select(cfg, per_rank) != converted:
            errors.append(f"{key}={value} means {per_rank}={converted} on {dp} data-parallel ranks, but {per_rank}="
                          f"{_select(cfg, per_rank)} is set too; keep one of the two keys")
            continue
        _assign(cfg, per_rank, converted)
    return errors
