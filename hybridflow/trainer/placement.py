"""Placement: which roles share processes, how many ranks, on which nodes — all from the trainer config.

``trainer.placement=colocate`` (default): one resource pool; the actor/rollout/ref worker, the critic and the reward
model are hosted in the same process per rank (one WorkerGroup per role over shared processes).
``trainer.placement=split``: the policy (actor + rollout + ref) gets its own pool and the critic / reward model another.
``actor_rollout_ref.hybrid_engine=false``: the rollout engine gets a WorkerGroup of its own (role "rollout") on its
own pool of ``actor_rollout_ref.rollout.nnodes * n_gpus_per_node`` processes; the actor (and ref) keep
``trainer.nnodes * trainer.n_gpus_per_node``. Its weights come over a transfer process group
(engines/weight_transfer.py, set up by trainer/rollout_driver.py).
``trainer.backend=local`` runs every role in the driver process (world size 1) for debugging with breakpoints.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hybridflow.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup, create_colocated_worker_groups
from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward_model import RewardLoopWorker, RewardModelWorker


@dataclass
class WorkerGroups:
    actor_rollout: WorkerGroup  # the actor (training side); also the rollout in the hybrid engine
    critic: WorkerGroup | None = None
    reward_model: WorkerGroup | None = None
    pools: list[ResourcePool] = field(default_factory=list)
    separate_rollout: WorkerGroup | None = None  # hybrid_engine=false: the rollout group on its own pool

    @property
    def rollout(self) -> WorkerGroup:
        """The group that generates: the separate rollout group, or the actor's own (hybrid engine)."""
        return self.separate_rollout if self.separate_rollout is not None else self.actor_rollout

    def all(self) -> list[WorkerGroup]:
        groups = (self.actor_rollout, self.critic, self.reward_model, self.separate_rollout)
        return [g for g in groups if g is not None]

    def init_models(self) -> list[Any]:
        """Every group's ``init_model()`` result, in ``all()`` order. Groups on the same processes build theirs one
        after another, in that order (each process runs one call at a time, and their collectives must not
        interleave); groups on processes of their own build at the same time, so a rollout group placed apart (or a
        reward loop) loads its model while the actor loads its own."""
        groups = self.all()
        sets: list[list[int]] = []  # indices of groups that share processes
        for i, group in enumerate(groups):
            same = next((s for s in sets if groups[s[0]].shares_processes_with(group)), None)
            if same is None:
                sets.append([i])
            else:
                same.append(i)
        if len(sets) == 1 or groups[0].backend == "local":  # local: every role runs in this process
            return [group.init_model() for group in groups]
        results: list[Any] = [None] * len(groups)

        def build(indices: list[int]) -> None:
            for i in indices:
                results[i] = groups[i].init_model()

        with ThreadPoolExecutor(len(sets), thread_name_prefix="init_model") as pool:
            futures = [pool.submit(build, indices) for indices in sets]
        for future in futures:  # all have finished; the first failure (in all() order) is raised
            future.result()
        return results

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


def build_rollout_group(cfg: Any, name: str = "rollout") -> tuple[WorkerGroup, ResourcePool | None]:
    """hybrid_engine=false: the rollout alone, on a pool of rollout.nnodes x rollout.n_gpus_per_node processes."""
    t, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    pool = None
    if t.backend != "local":
        pool = ResourcePool(
            process_on_nodes=[r.n_gpus_per_node] * r.nnodes, use_gpu=t.device == "cuda", num_cpus_per_process=1,
            max_colocate_count=1,  # no name: a unique one, so a replacement group can start before the old pool goes
        )
    group = WorkerGroup(
        pool, ClassWithInitArgs(ActorRolloutRefWorker, cfg, "rollout"), name_prefix=name, backend=t.backend,
        call_timeout_s=t.call_timeout_s, num_threads=threads_per_rank(cfg),
    )
    return group, pool


def start_rollout_group(cfg: Any) -> WorkerGroup:
    """A new rollout group with its engines built (what replaces one whose rank died)."""
    group, _pool = build_rollout_group(cfg)
    group.init_model()
    return group


def build_worker_groups(cfg: Any, *, need_ref: bool, need_critic: bool, need_rm: bool) -> WorkerGroups:
    t = cfg.trainer
    hybrid = cfg.actor_rollout_ref.hybrid_engine
    role = ("actor_rollout_ref" if need_ref else "actor_rollout") if hybrid else ("actor_ref" if need_ref else "actor")
    specs: dict[str, ClassWithInitArgs] = {"actor_rollout": ClassWithInitArgs(ActorRolloutRefWorker, cfg, role)}
    others: dict[str, ClassWithInitArgs] = {}
    if need_critic:
        others["critic"] = ClassWithInitArgs(CriticWorker, cfg)
    if need_rm and not cfg.reward_model.use_reward_loop:  # the reward loop gets processes of its own, below
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
    separate = None
    if not hybrid:
        separate, rollout_pool = build_rollout_group(cfg)
        pools.append(rollout_pool)
    if need_rm and cfg.reward_model.use_reward_loop:
        groups["reward_model"], rm_pool = build_reward_loop_group(cfg)
        pools.append(rm_pool)
    return WorkerGroups(
        actor_rollout=groups["actor_rollout"],
        critic=groups.get("critic"),
        reward_model=groups.get("reward_model"),
        pools=[p for p in pools if p is not None],
        separate_rollout=separate,
    )


def build_reward_loop_group(cfg: Any) -> tuple[WorkerGroup, ResourcePool | None]:
    """reward_model.use_reward_loop=true: the reward model's engine on a pool of its own (reward_loop_replicas
    processes, each with tensor_model_parallel_size devices on GPUs), never in the actor's processes."""
    from hybridflow.trainer.reward_loop import reward_loop_replicas

    t = cfg.trainer
    pool = None
    if t.backend != "local":
        pool = ResourcePool(
            process_on_nodes=[reward_loop_replicas(cfg)], use_gpu=t.device == "cuda", num_cpus_per_process=1,
            num_gpus_per_process=cfg.reward_model.rollout.tensor_model_parallel_size, max_colocate_count=1,
        )
    group = WorkerGroup(
        pool, ClassWithInitArgs(RewardLoopWorker, cfg), name_prefix="reward_loop", backend=t.backend,
        call_timeout_s=t.call_timeout_s, num_threads=threads_per_rank(cfg),
    )
    return group, pool
