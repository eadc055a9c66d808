"""Training -> generation resharding: from FSDP2 shards straight to each rollout rank's tensor-parallel slice.

FSDP2 keeps parameter ``p`` of full shape ``[N, ...]`` as row chunks over the W training ranks (rank i: rows
``[i*c, (i+1)*c)``, ``c = ceil(N / W)``, torch.chunk's split). The tensor-parallel rollout on the same W ranks wants,
on rank j, only the slice of ``p`` that its TP rank ``j % t`` holds (tensor_parallel.py ``tp_pieces``: row ranges
for column-parallel and vocabulary tensors, column ranges for row-parallel ones, the whole tensor for norms).

``resharded_parameters`` moves exactly that, one tensor at a time, with one ``all_to_all_single`` per tensor: rank i
sends rank j the intersection of its row chunk with j's slice, and rank j assembles its slice from the W blocks.
No rank ever holds a full tensor it does not keep (the replicated norms and biases aside), so per sync a rank
receives about ``model_bytes / t`` instead of ``model_bytes`` (``full_gather_parameters``, the all-gather baseline
that the hybrid engine uses at t = 1), and its transient memory is one slice plus its send/receive buffers instead
of one full tensor. Both functions record what they did in a ``SyncStats``.

Parameters that are not a 1-D ``Shard(0)`` DTensor over the whole default group (a single rank's plain tensors, or
another training layout) fall back to a full gather followed by a local slice; ``SyncStats.fallback_tensors``
counts them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["SyncStats", "full_gather_parameters", "resharded_parameters", "sync_tensor_parallel"]

# (dim, [(start, stop), ...]) in full-tensor coordinates, or None for the whole tensor (tensor_parallel.Pieces)
Pieces = tuple[int, list[tuple[int, int]]] | None
PiecesOf = Callable[[str, int], Pieces]  # (hf name, tp rank) -> pieces


@dataclass
class SyncStats:
    """What one weight sync moved on this rank. Bytes are payload bytes (what a rank receives from other ranks)."""

    tensors: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    bytes_kept: int = 0  # the slices this rank loaded (its rollout weights)
    peak_transient_bytes: int = 0  # largest per-tensor working set: buffers + gathered/assembled tensors
    fallback_tensors: int = 0
    seconds: float = 0.0
    _start: float = field(default_factory=time.perf_counter, repr=False)

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items() if not k.startswith("_")}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _take(tensor: torch.Tensor, pieces: Pieces) -> torch.Tensor:
    if pieces is None:
        return tensor
    dim, ranges = pieces
    parts = [tensor.narrow(dim, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _row_chunks(rows: int, world: int) -> list[tuple[int, int]]:
    """torch.chunk's (and so DTensor Shard(0)'s) row range of each rank."""
    c = math.ceil(rows / world) if rows else 0
    return [(min(i * c, rows), min((i + 1) * c, rows)) for i in range(world)]


def _blocks(pieces: Pieces, rows: tuple[int, int], shape: torch.Size) -> list[tuple[int, int, int, int, int]]:
    """The blocks of slice `pieces` that live in row chunk `rows`: (dim, range start, range stop, row lo, row hi),
    in the order a sender packs them and a receiver unpacks them."""
    dim, ranges = (0, [(0, shape[0])]) if pieces is None else pieces
    s0, s1 = rows
    if dim == 0:
        return [(0, a, b, max(a, s0), min(b, s1)) for a, b in ranges if min(b, s1) > max(a, s0)]
    return [(dim, a, b, s0, s1) for a, b in ranges if s1 > s0 and b > a]


def _is_row_sharded(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    if not (isinstance(param, DTensor) and dist.is_initialized()):
        return False
    mesh = param.device_mesh
    return (mesh.ndim == 1 and tuple(param.placements) == (Shard(0),) and mesh.size() == dist.get_world_size()
            and mesh.mesh.flatten().tolist() == list(range(dist.get_world_size())))


def resharded_parameters(named_params: Iterable[tuple[str, torch.Tensor]], pieces_of: PiecesOf,
                         tp_rank_of: list[int], stats: SyncStats | None = None,
                         device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's slice)`` for every parameter; a collective: every rank of the default group iterates.

    named_params: ``(hf_name, parameter)`` from the training engine (FSDP2 DTensors or plain tensors);
    pieces_of(name, tp_rank): the slice TP rank tp_rank keeps; tp_rank_of[j]: global rank j's TP rank.
    """
    stats = stats if stats is not None else SyncStats()
    world = dist.get_world_size() if dist.is_initialized() else 1
    me = dist.get_rank() if dist.is_initialized() else 0
    for name, param in named_params:
        param = param.detach()
        target = pieces_of(name, tp_rank_of[me])
        if not _is_row_sharded(param):
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            if device is not None:
                full = full.to(device)
            part = _take(full, target).contiguous()
            if full is not param:
                stats.bytes_received += _nbytes(full) * (world - 1) // world
                stats.fallback_tensors += 1
            stats.peak_transient_bytes = max(stats.peak_transient_bytes, _nbytes(full) + _nbytes(part))
            yield _record(stats, name, part)
            continue
        local = param.to_local()
        if device is not None:
            local = local.to(device)
        shape, chunks = param.shape, _row_chunks(param.shape[0], world)
        row_size = math.prod(shape[1:])  # elements per row of the full tensor

        def block_numel(dim: int, a: int, b: int, lo: int, hi: int, _row=row_size, _shape=shape) -> int:
            return (hi - lo) * (_row if dim == 0 else _row // _shape[dim] * (b - a))

        # what this rank sends to each other rank j: its rows of j's slice (its own rows it copies, below)
        sends, send_sizes = [], []
        for j in range(world):
            blocks = [] if j == me else _blocks(pieces_of(name, tp_rank_of[j]), chunks[me], shape)
            sends += [_local_block(local, chunks[me][0], blk).reshape(-1) for blk in blocks]
            send_sizes.append(sum(block_numel(*blk) for blk in blocks))
        recv_plan = [_blocks(target, chunks[i], shape) for i in range(world)]
        recv_sizes = [0 if i == me else sum(block_numel(*blk) for blk in blocks) for i, blocks in enumerate(recv_plan)]
        send = torch.cat(sends) if sends else local.new_empty(0)
        recv = local.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes)
        part = _assemble(recv, recv_plan, recv_sizes, target, shape, local, me, chunks[me][0])
        elem = local.element_size()
        stats.bytes_sent += sum(send_sizes) * elem
        stats.bytes_received += sum(recv_sizes) * elem
        stats.peak_transient_bytes = max(stats.peak_transient_bytes, _nbytes(send) + _nbytes(recv) + _nbytes(part))
        yield _record(stats, name, part)
    stats.seconds = time.perf_counter() - stats._start


def _local_block(local: torch.Tensor, first_row: int, block: tuple[int, int, int, int, int]) -> torch.Tensor:
    """A view of block (dim, a, b, lo, hi) in a rank's row chunk `local` (whose first full-tensor row is first_row)."""
    dim, a, b, lo, hi = block
    rows = local.narrow(0, lo - first_row, hi - lo)
    return rows if dim == 0 else rows.narrow(dim, a, b - a)


def _assemble(recv: torch.Tensor, plan: list, sizes: list[int], target: Pieces, shape: torch.Size,
              local: torch.Tensor, me: int, first_row: int) -> torch.Tensor:
    """This rank's slice: source i's blocks from the flat `recv` (at offset sum(sizes[:i]), in plan[i]'s order), its
    own blocks straight from its shard `local`."""
    like = local
    dim, ranges = (0, [(0, shape[0])]) if target is None else target
    out_shape = list(shape)
    out_shape[dim] = sum(b - a for a, b in ranges)
    out = like.new_empty(out_shape)
    starts, acc = {}, 0
    for a, b in ranges:  # where each range begins along dim in the slice
        starts[(a, b)], acc = acc, acc + (b - a)
    offset = 0
    for i, blocks in enumerate(plan):
        pos = offset
        for d, a, b, lo, hi in blocks:
            if d == 0:
                dest = out.narrow(0, starts[(a, b)] + lo - a, hi - lo)
            else:
                dest = out.narrow(0, lo, hi - lo).narrow(d, starts[(a, b)], b - a)
            if i == me:
                dest.copy_(_local_block(local, first_row, (d, a, b, lo, hi)))
                continue
            dest.copy_(recv[pos : pos + dest.numel()].view(dest.shape))
            pos += dest.numel()
        offset += sizes[i]
    return out


def _record(stats: SyncStats, name: str, part: torch.Tensor) -> tuple[str, torch.Tensor]:
    stats.tensors += 1
    stats.bytes_kept += _nbytes(part)
    return name, part


def full_gather_parameters(named_params: Iterable[tuple[str, torch.Tensor]], stats: SyncStats | None = None,
                           device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The baseline: every rank all-gathers every full tensor (what the t = 1 sync does); ``(name, full tensor)``."""
    stats = stats if stats is not None else SyncStats()
    world = dist.get_world_size() if dist.is_initialized() else 1
    for name, param in named_params:
        param = param.detach()
        if device is not None:
            param = param.to(device)
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        if full is not param:
            local = param.to_local()
            stats.bytes_received += _nbytes(full) - _nbytes(local)
            stats.bytes_sent += _nbytes(local) * (world - 1)
        stats.peak_transient_bytes = max(stats.peak_transient_bytes, _nbytes(full))
        yield _record(stats, name, full)
    stats.seconds = time.perf_counter() - stats._start


def sync_tensor_parallel(model: torch.nn.Module, rollout) -> SyncStats:
    """Load every parameter of the (FSDP2-sharded) training `model` into a tensor-parallel native rollout on the same
    ranks, each rank receiving its own slice; a collective over the default group. Returns this rank's SyncStats."""
    from hybridflow.engines.hf_model import hf_name

    tp, stats = rollout.tensor_parallel, SyncStats()
    world = dist.get_world_size()
    named = ((hf_name(n), p) for n, p in model.named_parameters())
    slices = resharded_parameters(named, rollout.model.tp_pieces, [j % tp.size for j in range(world)], stats,
                                  device=rollout.device)
    rollout.update_weight_slices(slices)
    return stats
