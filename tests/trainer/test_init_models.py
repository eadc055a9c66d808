"""WorkerGroups.init_models: groups on processes of their own build their models at the same time (a rollout group
placed apart loads while the actor loads); groups sharing processes build one after another, in order."""

from __future__ import annotations

import sys
import time

from hybridflow.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    create_colocated_worker_groups,
    register,
)
from hybridflow.trainer.placement import WorkerGroups

BUILD_S = 3.0  # long against the time a call takes to reach a rank, so "at the same time" cannot happen by chance


class SlowBuild(Worker):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        start = time.time()
        time.sleep(BUILD_S)
        return {"role": self.role, "start": start, "end": time.time()}


def test_groups_on_processes_of_their_own_build_at_once_and_shared_ones_in_order(ray_session):
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test modules do not import in workers
    pools = [ResourcePool(process_on_nodes=[1]) for _ in range(2)]
    shared = create_colocated_worker_groups(pools[0], {role: ClassWithInitArgs(SlowBuild, role) for role in
                                                       ("actor", "critic")}, name_prefix="init")
    apart = WorkerGroup(pools[1], ClassWithInitArgs(SlowBuild, "rollout"), name_prefix="init_rollout")
    groups = WorkerGroups(actor_rollout=shared["actor"], critic=shared["critic"], separate_rollout=apart, pools=pools)
    try:
        assert shared["actor"].shares_processes_with(shared["critic"])
        assert not apart.shares_processes_with(shared["actor"])
        actor, critic, rollout = (per_rank[0] for per_rank in groups.init_models())
        assert [actor["role"], critic["role"], rollout["role"]] == ["actor", "critic", "rollout"]
        assert critic["start"] >= actor["end"]  # one process: the actor's build, then the critic's
        assert rollout["start"] < actor["end"] and actor["start"] < rollout["end"]  # apart: overlapping
    finally:
        groups.shutdown()
