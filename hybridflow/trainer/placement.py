"""Placement: which roles share processes, how many ranks, on which nodes — all from the trainer config.

``trainer.placement=colocate`` (default): one resource pool; the actor/rollout/ref worker, the critic and the reward
model are hosted in the same process per rank (one WorkerGroup per role over shared processes).
``trainer.placement=split``: the policy (actor + rollout + ref) gets its own pool and the critic / reward model another.
``trainer.backend=local`` runs every role in the driver process (world size 1) for debugging with breakpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hybridflow.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup, create_colocated_worker_groups
from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward_model import RewardModelWorker


@dataclass
class WorkerGroups:
    actor_rollout: WorkerGroup
    critic: WorkerGroup | None = None
    reward_model: WorkerGroup | None = None
    pools: list[ResourcePool] = field(default_factory=list)

    def all(self) -> list[WorkerGroup]:
        return [g for g in (self.actor_rollout, self.critic, self.reward_model) if g is not None]

    def shutdown(self) -> None:
        for g in self.all():
            g.shutdown()
        for p in self.pools:
            remove = getattr(p, "remove", None) or getattr(p, "shutdown", None)
            if remove is not None:
                remove()


def threads_per_rank(cfg: Any) -> int:
    if cfg.trainer.num_threads_per_worker:
        return int(cfg.trainer.num_threads_per_worker)
    return max(1, (os.cpu_count() or 1) // max(1, cfg.trainer.n_gpus_per_node))


def build_worker_groups(cfg: Any, *, need_ref: bool, need_critic: bool, need_rm: bool) -> WorkerGroups:
    t = cfg.trainer
    role = "actor_rollout_ref" if need_ref else "actor_rollout"
    specs: dict[str, ClassWithInitArgs] = {"actor_rollout": ClassWithInitArgs(ActorRolloutRefWorker, cfg, role)}
    others: dict[str, ClassWithInitArgs] = {}
    if need_critic:
        others["critic"] = ClassWithInitArgs(CriticWorker, cfg)
    if need_rm:
        others["reward_model"] = ClassWithInitArgs(RewardModelWorker, cfg)
    use_gpu = t.device == "cuda"
    common = dict(
        backend=t.backend,
        call_timeout_s=t.call_timeout_s,
        num_threads=threads_per_rank(cfg),
    )

    def pool(name: str) -> ResourcePool | None:
        if t.backend == "local":
            return None
        return ResourcePool(
            process_on_nodes=[t.n_gpus_per_node] * t.nnodes,
            use_gpu=use_gpu,
            num_cpus_per_process=1,
            max_colocate_count=1,
            name=name,
        )

    pools = []
    if t.placement == "colocate" or not others:
        p = pool("hybridflow_all")
        pools.append(p)
        groups = create_colocated_worker_groups(p, {**specs, **others}, name_prefix="hf", **common)
    else:
        p1, p2 = pool("hybridflow_policy"), pool("hybridflow_value")
        pools += [p1, p2]
        groups = create_colocated_worker_groups(p1, specs, name_prefix="policy", **common)
        groups.update(create_colocated_worker_groups(p2, others, name_prefix="value", **common))
    return WorkerGroups(
        actor_rollout=groups["actor_rollout"],
        critic=groups.get("critic"),
        reward_model=groups.get("reward_model"),
        pools=[p for p in pools if p is not None],
    )
