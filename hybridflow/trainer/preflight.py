"""Checks that need the data, the cluster or the device, run before the first step (and by ``--dry-run``).

`validate_config` (config.py) judges the settings alone. What it cannot know -- which data sources the files hold,
how many nodes and GPUs the cluster has -- is checked here, so that a run never trains for an hour and then fails at
its first validation, or waits for nodes that do not exist. Every check returns messages that name the key and the
fix; `preflight_errors` returns them all at once (an empty list: ready to start).
"""

from __future__ import annotations

from typing import Any

__all__ = ["preflight_errors"]


def preflight_errors(cfg: Any, *, train_ds: Any = None, val_ds: Any = None,
                     cluster_resources: dict[str, float] | None = None) -> list[str]:
    """Everything that would stop the run after it started, as messages. `cluster_resources` is Ray's
    ``ray.cluster_resources()`` of the cluster the run will use (None: not started yet; then only local checks)."""
    errors = _estimator_errors(cfg)
    for ds in (train_ds, val_ds):
        if ds is not None:
            errors += _scorer_errors(cfg, ds)
            errors += _agent_name_errors(cfg, ds)
    errors += _device_errors(cfg, cluster_resources)
    errors += _model_layout_errors(cfg)
    if cluster_resources is not None:
        errors += _cluster_errors(cfg, cluster_resources)
    else:
        from hybridflow.trainer.reward_loop import reward_model_tokenizer_errors
        from hybridflow.trainer.tracking import logger_errors
        from hybridflow.trainer.verl_model_keys import model_folder_errors

        errors += _rollout_model_errors(cfg)
        errors += _resume_errors(cfg)
        errors += model_folder_errors(cfg)
        errors += reward_model_tokenizer_errors(cfg)
        errors += logger_errors(cfg.trainer.logger)
    return errors


def _resume_errors(cfg: Any) -> list[str]:
    """A checkpoint named to resume from (trainer.resume_mode=<path>, or veRL's resume_from_path) that is missing or
    damaged, found before the workers start rather than after they loaded their models."""
    mode = cfg.trainer.resume_mode
    if mode == "resume_path":  # veRL's spelling; main.py turns it into the path itself
        mode = cfg.trainer.resume_from_path
    if not mode or mode == "disable":
        return []
    from hybridflow.trainer.checkpoint import CheckpointError, CheckpointManager

    try:
        found = CheckpointManager(cfg.trainer.default_local_dir).resolve(mode)
    except CheckpointError as e:
        if mode == "auto":
            return []  # the run folder's own checks say it (run_dir.py), with what to do
        via_path = cfg.trainer.resume_from_path and mode == cfg.trainer.resume_from_path
        key = "trainer.resume_from_path" if via_path else "trainer.resume_mode"
        return [str(e).replace("trainer.resume_mode=", f"{key}=")]
    return _resume_world_errors(cfg, found) if found else []


def _resume_world_errors(cfg: Any, checkpoint: str) -> list[str]:
    """A checkpoint's sharded roles resume on as many ranks as wrote them (each rank reads its own shard file)."""
    import json
    import os

    from hybridflow.engines.checkpoint_io import META_FILE

    t = cfg.trainer
    world = t.nnodes * t.n_gpus_per_node
    errors = []
    for role in ("actor", "critic"):
        meta = os.path.join(checkpoint, role, META_FILE)
        try:
            with open(meta) as f:
                written = int(json.load(f)["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not this role's checkpoint, or one the engine's own check will name
        if written != world:
            errors.append(
                f"the checkpoint to resume from, {checkpoint}, holds {role} shards of {written} ranks and this run "
                f"has {world} (trainer.nnodes*trainer.n_gpus_per_node); resume with {written} ranks, or start a "
                f"new run from its weights: `hybridflow export {checkpoint} OUT_DIR`, then "
                "actor_rollout_ref.model.path=OUT_DIR in another trainer.default_local_dir")
    return errors


def _rollout_model_errors(cfg: Any) -> list[str]:
    """What the chosen rollout engine cannot run in this model (asked of the engine: RolloutEngine.model_errors)."""
    from hybridflow.engines.rollout.registry import get_rollout_engine

    path = cfg.actor_rollout_ref.model.path
    if not path:
        return []
    try:
        engine = get_rollout_engine(cfg.actor_rollout_ref.rollout.name)
    except (ValueError, ImportError):
        return []  # validate_config names it
    return [f"actor_rollout_ref.rollout.name={cfg.actor_rollout_ref.rollout.name}: {m}" for m in engine.model_errors(path)]


def _model_layout_errors(cfg: Any) -> list[str]:
    """The model's heads / KV heads / MLP width against the rollout's tensor-parallel size (parallel_checks.py)."""
    from hybridflow.trainer.parallel_checks import model_layout_errors

    return model_layout_errors(cfg)


def _estimator_errors(cfg: Any) -> list[str]:
    from hybridflow.algorithms.registry import ADVANTAGE_ESTIMATORS

    alg, n = cfg.algorithm, cfg.actor_rollout_ref.rollout.n
    if ADVANTAGE_ESTIMATORS.check(alg.adv_estimator):
        return []  # validate_config names it
    if getattr(ADVANTAGE_ESTIMATORS.get(alg.adv_estimator), "needs_group_index", False) and n == 1:
        return [
            f"algorithm.adv_estimator={alg.adv_estimator} compares the responses to each prompt with each other; with "
            "actor_rollout_ref.rollout.n=1 every advantage is 0 and nothing is learned: set "
            "actor_rollout_ref.rollout.n >= 2, or choose a critic-based estimator (algorithm.adv_estimator=gae)"
        ]
    return []


def _scorer_errors(cfg: Any, ds: Any) -> list[str]:
    """Every data source of `ds` needs a scorer, unless a custom reward function scores them all."""
    if cfg.custom_reward_function.path:
        return []
    from hybridflow.rewards import ScorerTable, available_scorers

    key = cfg.data.reward_fn_key
    known, table = set(available_scorers()), ScorerTable()
    counts = ds.data_source_counts(key)
    missing = {source: c for source, c in counts.items() if not table.knows(source)}  # "family/*" names count
    if not missing:
        return []
    listed = ", ".join(f"{s!r} ({c} rows)" for s, c in sorted(missing.items()))
    return [
        f"{ds.name} data ({', '.join(ds.files)}): no reward function for data source(s) {listed} (column "
        f"{key!r}); known: {sorted(known)}. Set custom_reward_function.path=path/to/file.py "
        "custom_reward_function.name=fn, or register a scorer with hybridflow.rewards.register_scorer before training"
    ]


def _agent_name_errors(cfg: Any, ds: Any) -> list[str]:
    """Rows whose agent_name (veRL's per-row agent loop) hybridflow cannot run with this config."""
    from hybridflow.workers.agent_rollout import agent_name_errors

    return agent_name_errors(cfg, ds.data_source_counts("agent_name"), f"{ds.name} data ({', '.join(ds.files)})")


def _on_cpu(cfg: Any, cluster_resources: dict[str, float] | None) -> bool:
    """Whether the run's workers will be on CPUs (False when that is not known yet: a cluster to join)."""
    t = cfg.trainer
    if t.device != "auto":
        return t.device == "cpu"
    if cluster_resources is not None:
        return not cluster_resources.get("GPU", 0)
    if t.backend == "ray" and t.ray_address:
        return False
    import torch

    return not torch.cuda.is_available()


def _device_errors(cfg: Any, cluster_resources: dict[str, float] | None) -> list[str]:
    t = cfg.trainer
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "vllm" and rollout.free_cache_engine and _on_cpu(cfg, cluster_resources):
        from hybridflow.engines.vllm_classes import CPU_SLEEP_MODE

        return [CPU_SLEEP_MODE]
    if t.device != "cuda":
        return []
    if cluster_resources is not None:
        gpus = cluster_resources.get("GPU", 0)
        where = "the Ray cluster reports 0 GPUs"
    elif t.backend == "ray" and t.ray_address:
        return []  # the cluster's GPUs are known once it is joined
    else:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        where = "torch.cuda.is_available() is False on this machine"
    if gpus == 0:
        return [f"trainer.device=cuda but no GPU is visible ({where}); set trainer.device=cpu, or auto to use a GPU "
                "when there is one"]
    return []


def _cluster_errors(cfg: Any, res: dict[str, float]) -> list[str]:
    t = cfg.trainer
    # Ray publishes one "node:<ip>" resource per node (plus "node:__internal_head__" on the head).
    nodes = sum(1 for k in res if k.startswith("node:") and k != "node:__internal_head__")
    if t.nnodes > nodes:
        return [f"trainer.nnodes={t.nnodes} but the Ray cluster has {nodes} node(s); lower trainer.nnodes, or join "
                "more nodes (ray start --address=...) and pass trainer.ray_address"]
    return []
