"""The tests' rank pool (tests/rank_pool.py): processes kept between uses, a new gloo group of the asked size each
time, and new processes after a use that failed."""

from __future__ import annotations

import os
import sys

import pytest
import ray
from rank_pool import RankPool, on_all

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Probe:
    def __init__(self, tag: str) -> None:
        import torch.distributed as dist

        self.tag, self.rank, self.world = tag, dist.get_rank(), dist.get_world_size()

    def who(self) -> tuple:
        return os.getpid(), self.tag, self.rank, self.world

    def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value])
        dist.all_reduce(t)
        return float(t)

    def fail(self) -> None:
        raise RuntimeError("a rank's own error")


def test_processes_are_kept_each_use_has_its_own_group_and_a_failed_use_leaves_new_ones(ray_session):
    pool = RankPool()  # not a test file's: this test kills its processes
    try:
        with pool.spmd(1, Probe, "a") as ranks:
            first = on_all(ranks, "who")
            assert [(tag, rank, world) for _, tag, rank, world in first] == [("a", 0, 1)]
        with pool.spmd(2, Probe, "b") as ranks:
            second = on_all(ranks, "who")
            assert [(tag, rank, world) for _, tag, rank, world in second] == [("b", 0, 2), ("b", 1, 2)]
            assert on_all(ranks, "all_reduce", [1.0, 2.0]) == [3.0, 3.0]
        assert second[0][0] == first[0][0]  # the same process, then one more
        with pytest.raises(ray.exceptions.RayTaskError, match="a rank's own error"), \
                pool.spmd(2, Probe, "failing") as ranks:
            on_all(ranks, "fail")
        assert pool.hosts == []
        with pool.spmd(1, Probe, "after") as ranks:
            assert on_all(ranks, "who")[0][0] not in {pid for pid, *_ in second}
            assert on_all(ranks, "all_reduce", [5.0]) == [5.0]
    finally:
        pool.kill()
