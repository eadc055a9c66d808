"""A tensor-parallel group's collectives in shared memory (engines/rollout/shm_collectives.py) on real gloo ranks of
one host: the sum in rank order on every rank, bit for bit, in chunks larger than a slot; bf16 summed in fp32 and
rounded once; the all-gather and the first rank's tensor; the group agrees on the path; a missing peer is an error,
not a hang; the segment's file is gone once every rank has mapped it."""

from __future__ import annotations

import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import ray
import torch
import torch.distributed as dist
from rank_pool import on_all

from hybridflow.engines import shm_process_group
from hybridflow.engines.rollout import shm_collectives
from hybridflow.engines.rollout.shm_collectives import TPCollectives

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Without a compiler the kernel cannot exist (the group keeps torch.distributed's collectives); with one, a kernel that
# does not build is a failure (test_the_kernel_builds), not a skip.
pytestmark = pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")),
                                reason="no C compiler to build the kernel")


def test_the_kernel_builds():
    assert shm_collectives.load() is not None


def inputs(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    # 3 floats, a decode step's [16, 128], and 5,000 floats: 20 KB, many 256-byte slots (chunks and a partial one)
    return [torch.randn(shape, generator=g).to(dtype) for shape in ((3,), (16, 128), (5000,))]


class ShmRank:
    def __init__(self, mode: str = "auto", elsewhere_rank: int | None = None, timeout_s: float = 60.0,
                 switched_off: bool = False):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        tp = SimpleNamespace(group=None, size=self.world, rank=self.rank, src=0)
        own_host = shm_collectives._host_id
        if self.rank == elsewhere_rank:  # this rank says it is on another machine
            shm_collectives._host_id = lambda: "another-host"
        if switched_off:
            os.environ["HYBRIDFLOW_SHM_COLLECTIVES"] = "0"
        try:
            self.c, self.error = TPCollectives(tp, "cpu", mode, slot_bytes=256, timeout_s=timeout_s), None
        except RuntimeError as err:
            self.c, self.error = None, str(err)
        finally:  # the rank process is kept for the file's other tests
            shm_collectives._host_id = own_host
            os.environ.pop("HYBRIDFLOW_SHM_COLLECTIVES", None)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.c.all_reduce(x.clone())

    def info(self) -> dict:
        c = self.c
        return {"error": self.error, "kind": None if c is None else c.kind,
                "path_left": None if c is None or c.shm is None else os.path.exists(c.shm.path)}

    def reduce_and_gather(self) -> dict:
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            out[f"reduce_{dtype}"] = [self.c.all_reduce(x.clone()) for x in inputs(self.rank, dtype)]
        mine = [torch.full((5,), self.rank, dtype=torch.int64), torch.randn(3, 1001) + self.rank]
        out["gather"] = [self.c.all_gather(x) for x in mine]
        out["mine"] = mine
        out["first"] = self.c.from_first_rank(torch.arange(7) * (self.rank + 1))
        return out

    def reduce_alone(self) -> str:
        """Rank 0 all-reduces while its peers do not: the wait must end in an error."""
        if self.rank != 0:
            return ""
        try:
            self.c.all_reduce(torch.ones(4))
        except RuntimeError as err:
            return str(err)
        return "returned"


def rank_order_sum(dtype: torch.dtype, world: int) -> list[torch.Tensor]:
    per_rank = [inputs(r, dtype) for r in range(world)]
    sums = []
    for i in range(len(per_rank[0])):
        acc = per_rank[0][i].float()
        for r in range(1, world):
            acc = acc + per_rank[r][i].float()
        sums.append(acc.to(dtype))
    return sums


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_in_shared_memory(rank_pool, world):
    with rank_pool.spmd(world, ShmRank) as ranks:
        info = on_all(ranks, "info")
        results = on_all(ranks, "reduce_and_gather")
    assert all(i["kind"] == "shm" and i["path_left"] is False for i in info), info
    for dtype in (torch.float32, torch.bfloat16):
        expected = rank_order_sum(dtype, world)
        for res in results:  # every rank holds the sum in rank order, bit for bit
            for got, want in zip(res[f"reduce_{dtype}"], expected):
                assert got.dtype == dtype and torch.equal(got, want)
    for res in results:
        for j, gathered in enumerate(res["gather"]):
            assert [torch.equal(gathered[r], results[r]["mine"][j]) for r in range(world)] == [True] * world
        assert torch.equal(res["first"], torch.arange(7))


def test_two_ranks_sum_as_torch_distributed_does(rank_pool):
    """With two ranks a sum has one rounding: shared memory and gloo give the same bits."""
    x = [inputs(r, torch.float32)[1] for r in range(2)]
    sums = {}
    for mode in ("torch", "auto"):
        with rank_pool.spmd(2, ShmRank, mode) as ranks:
            assert [i["kind"] for i in on_all(ranks, "info")] == [{"torch": "torch", "auto": "shm"}[mode]] * 2
            sums[mode] = on_all(ranks, "reduce", x)
    for a, b in zip(sums["torch"], sums["auto"]):
        assert torch.equal(a, b) and torch.equal(a, x[0] + x[1])


@pytest.mark.parametrize("mode", ["auto", "shm"])
def test_the_group_agrees_on_one_path(rank_pool, mode):
    """One rank on another host: every rank keeps torch.distributed's collectives ('auto'), or every rank refuses
    ('shm'), and none waits on a path its peers did not take."""
    with rank_pool.spmd(2, ShmRank, mode, 1) as ranks:
        info = on_all(ranks, "info")
        if mode == "auto":
            assert [i["kind"] for i in info] == ["torch", "torch"]
            assert on_all(ranks, "reduce", [torch.ones(3), torch.ones(3)])[0].tolist() == [2.0, 2.0, 2.0]
    if mode == "shm":
        assert all(i["kind"] is None and "more than one host" in i["error"] for i in info), info


def test_the_environment_switches_it_off(rank_pool):
    with rank_pool.spmd(2, ShmRank, "auto", None, 60.0, True) as ranks:
        assert [i["kind"] for i in on_all(ranks, "info")] == ["torch", "torch"]
    with rank_pool.spmd(2, ShmRank, "shm", None, 60.0, True) as ranks:
        assert all("HYBRIDFLOW_SHM_COLLECTIVES=0" in i["error"] for i in on_all(ranks, "info"))


def test_a_missing_peer_is_an_error_not_a_hang(rank_pool):
    with rank_pool.spmd(2, ShmRank, "auto", None, 0.5) as ranks:
        messages = on_all(ranks, "reduce_alone")
    assert "waited 0.5 s for its peers" in messages[0], messages


def test_bad_settings_are_refused():
    tp = SimpleNamespace(group=None, size=2, rank=0, src=0)
    with pytest.raises(ValueError, match="tp_collectives='nccl'"):
        TPCollectives(tp, "cpu", "nccl")
    with pytest.raises(ValueError, match="slot_bytes=100"):
        TPCollectives(tp, "cpu", "auto", slot_bytes=100)


class GroupOps:
    """Every collective of the shared-memory process group against gloo's on the same ranks (integer-valued floats:
    every summation order gives the same bits)."""

    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        shm_process_group.register()
        self.groups = {"shm": dist.new_group(backend=shm_process_group.BACKEND), "gloo": dist.new_group(backend="gloo")}

    def run(self, name: str) -> dict:
        g, r, w = self.groups[name], self.rank, self.world
        x = torch.arange(12, dtype=torch.float32).reshape(4, 3) * (r + 1)
        out = {"backend": dist.get_backend(g)}
        for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
            y = x.clone() + 1
            dist.all_reduce(y, op=getattr(dist.ReduceOp, op), group=g)
            out[op] = y
        t = x.t()  # not contiguous: reduced through a copy, written back
        dist.all_reduce(t, group=g)
        out["strided"] = x
        out["bf16"] = x.to(torch.bfloat16)
        dist.all_reduce(out["bf16"], group=g)
        out["ints"] = torch.tensor([r, 2 * r + 1])
        dist.all_reduce(out["ints"], group=g)
        out["gather_list"] = [torch.empty(4, 3) for _ in range(w)]
        dist.all_gather(out["gather_list"], x, group=g)
        out["gather_flat"] = torch.empty(4 * w, 3)
        dist.all_gather_into_tensor(out["gather_flat"], x, group=g)
        out["reduce_scatter"] = torch.empty(4, 3)
        dist.reduce_scatter_tensor(out["reduce_scatter"], torch.cat([x] * w), group=g)
        # every piece different; then pieces of 300,001 floats: several 2 MiB rounds and a partial one, and bf16
        out["reduce_scatter_pieces"] = torch.empty(4, 3)
        dist.reduce_scatter_tensor(out["reduce_scatter_pieces"], torch.cat([x + 100 * k for k in range(w)]), group=g)
        m = 300_001
        big = (torch.arange(w * m) % 1000).float() * (r + 1)
        out["reduce_scatter_big"] = torch.empty(m)
        dist.reduce_scatter_tensor(out["reduce_scatter_big"], big, group=g)
        out["reduce_scatter_avg"] = torch.empty(m)
        dist.reduce_scatter_tensor(out["reduce_scatter_avg"], big, op=dist.ReduceOp.AVG, group=g)
        out["reduce_scatter_bf16"] = torch.empty(m, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(out["reduce_scatter_bf16"], (big % 7).bfloat16(), group=g)
        out["gather_big"] = torch.empty(w * m)
        dist.all_gather_into_tensor(out["gather_big"], big[:m] + r, group=g)
        out["reduce_scatter_list"] = torch.empty(4, 3)
        dist.reduce_scatter(out["reduce_scatter_list"], [x + k for k in range(w)], group=g)
        out["broadcast"] = x.clone()
        dist.broadcast(out["broadcast"], src=w - 1, group=g)
        out["scatter"] = torch.empty(2)
        dist.scatter(out["scatter"], [torch.full((2,), float(k)) for k in range(w)] if r == 0 else None, src=0,
                     group=g)
        out["all_to_all"] = torch.empty(2 * w)
        dist.all_to_all_single(out["all_to_all"], torch.arange(2 * w, dtype=torch.float32) + 10 * r, group=g)
        dist.barrier(group=g)
        return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_process_group_gives_gloos_results(rank_pool, world):
    with rank_pool.spmd(world, GroupOps) as ranks:
        shm, gloo = on_all(ranks, "run", ["shm"] * world), on_all(ranks, "run", ["gloo"] * world)
    for a, b in zip(shm, gloo):
        assert a.pop("backend") == "hybridflow_shm" and b.pop("backend") == "gloo"
        for key in a:
            got, want = a[key], b[key]
            if isinstance(got, list):
                assert all(torch.equal(g, h) for g, h in zip(got, want)), key
            else:
                assert got.dtype == want.dtype and torch.equal(got, want), (key, got, want)
