"""A checkpoint's per-rank files record which global indices each shard holds (`shard_index_runs`), so the full
tensors come back offline. The truth here is torch's own `distribute_tensor` (split locally, no communication) on
every rank of a fake process group: uneven sizes, FSDP2's strided shards over TP, shards on two dims, replicas."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from hybridflow.engines.checkpoint_io import assemble_full_state, shard_index_runs

CASES = [
    # mesh shape, placements, tensor shape
    ((3,), (Shard(0),), (10, 4)),  # 4 / 4 / 2 rows
    ((4,), (Shard(0),), (3, 5)),  # a rank with no rows
    ((2, 2), (_StridedShard(0, split_factor=2), Shard(0)), (11, 5)),  # FSDP over a colwise TP weight
    ((3, 2), (_StridedShard(0, split_factor=2), Shard(0)), (13, 3)),
    ((2, 3), (_StridedShard(0, split_factor=3), Shard(0)), (17,)),
    ((2, 2), (Shard(0), Shard(1)), (7, 9)),  # FSDP over a rowwise TP weight
    ((2, 2), (Shard(0), Replicate()), (9, 4)),  # a norm or embedding TP leaves whole
    ((2, 2), (Replicate(), Shard(1)), (4, 6)),
    ((2, 2), (Shard(1), Shard(1)), (3, 5)),
]


def _locals(mesh_shape, placements, full):
    """Every rank's local shard as torch splits it, with that rank's coordinate."""
    world = 1
    for n in mesh_shape:
        world *= n
    out = []
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            local = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local().clone()
            out.append((local, mesh.get_coordinate()))
        finally:
            dist.destroy_process_group()
    return out


@pytest.mark.parametrize("mesh_shape, placements, shape", CASES)
def test_recorded_indices_are_where_torch_puts_each_shard(mesh_shape, placements, shape):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    shards, layouts = [], []
    for local, coordinate in _locals(mesh_shape, placements, full):
        runs = shard_index_runs(shape, mesh_shape, coordinate, placements)
        index = [torch.tensor([i for a, b in runs[d] for i in range(a, b)], dtype=torch.long) if d in runs
                 else torch.arange(n) for d, n in enumerate(shape)]
        assert torch.equal(full[torch.meshgrid(*index, indexing="ij")], local), (coordinate, runs)
        shards.append({"w": local})
        layouts.append({"w": {str(d): r for d, r in runs.items()}})
    back = assemble_full_state(shards, layouts, {"w": list(shape)}, "ckpt")
    assert torch.equal(back["w"], full)

    if len(shards) > 1 and any(s["w"].numel() for s in shards[1:]):  # a rank's file missing: named, not zeros
        holders = [i for i, s in enumerate(shards) if s["w"].numel()]
        drop = holders[-1]
        replicated = all(p.is_replicate() for p in placements)
        if not replicated and not _duplicated(shards, drop):
            with pytest.raises(ValueError, match=r"ckpt: w: the shards cover \d+ of \d+ values"):
                assemble_full_state([s for i, s in enumerate(shards) if i != drop],
                                    [la for i, la in enumerate(layouts) if i != drop], {"w": list(shape)}, "ckpt")


def _duplicated(shards, drop):
    """Whether another rank holds the very same shard (a replica), so leaving `drop` out loses nothing."""
    return any(i != drop and torch.equal(s["w"], shards[drop]["w"]) for i, s in enumerate(shards))


def test_files_without_a_layout_join_fsdp_rows_and_name_what_does_not_fit():
    full = torch.arange(20.0).view(5, 4)
    shards = [{"w": full[:3]}, {"w": full[3:]}]
    assert torch.equal(assemble_full_state(shards, [None, None], {"w": [5, 4]}, "old")["w"], full)
    tp_halves = [{"w": full[:, :2]}, {"w": full[:, 2:]}]
    with pytest.raises(ValueError, match=r"old: w: assembled shape \[10, 2\] != recorded \[5, 4\].*predate"):
        assemble_full_state(tp_halves, [None, None], {"w": [5, 4]}, "old")


def test_partial_values_are_refused():
    with pytest.raises(ValueError, match="partial values"):
        shard_index_runs((4,), (2,), [0], (Partial(),))


def test_shards_from_different_runs_that_overlap_are_named():
    full = torch.arange(20.0).view(5, 4)
    shards = [{"w": full[:3]}, {"w": full[2:]}]
    layouts = [{"w": {"0": [[0, 3]]}}, {"w": {"0": [[2, 5]]}}]
    with pytest.raises(ValueError, match=r"ckpt: w: two shards hold overlapping pieces"):
        assemble_full_state(shards, layouts, {"w": [5, 4]}, "ckpt")
    with pytest.raises(ValueError, match=r"does not match its layout"):
        assemble_full_state([{"w": full[:2]}], [{"w": {"0": [[0, 3]]}}], {"w": [5, 4]}, "ckpt")
