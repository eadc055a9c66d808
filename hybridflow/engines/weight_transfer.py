"""Streaming the actor's weights to a rollout group that lives in other processes (``hybrid_engine=false``).

    group = TransferGroup.join(addr, port, rank, world_size)       # rank 0: the actor's sender, 1..N: rollout ranks
    stats = send_weights(group, engine.named_full_parameters(), manifest, version=7, bucket_bytes=64 << 20)   # rank 0
    incoming = ReceivedWeights(group, manifest, bucket_bytes=64 << 20)    # ranks 1..N: reads the header (version)
    rollout.update_weights(incoming)                                       # tensors in manifest order, verified

The transfer group is a second torch.distributed process group, separate from each WorkerGroup's own: its store is a
TCPStore hosted by the sender, and the backend object is built directly (gloo on CPU, nccl on GPUs), so the
processes' default groups are left alone. The sender gathers one full tensor at a time (FSDP2 all-gather on the actor
ranks), packs the bytes into one fixed-size bucket and broadcasts the bucket when it is full: the sender never holds
more than one full tensor plus one bucket, the receivers one bucket plus the tensor being assembled. A tensor larger
than a bucket spans several. No disk, no Ray object store.

Every transfer starts with a header ``[magic, version, number of buckets, total bytes]`` and every bucket is followed
by its checksum (the int64 sums of its int32 words and of its odd-indexed words). A receiver whose bucket does not
match raises ``WeightTransferError`` naming the version, the bucket and the rank, so a silent desync cannot happen;
its engine must then get a full transfer again before it generates (the worker enforces that).

The manifest (names, shapes, dtypes, in the sender's order) travels once, through the driver, when the group is set up.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow import device
from hybridflow.common.ports import tcp_store

MAGIC = 0x48464C57  # "HFLW": a header that is not this is a stream out of step
_HEADER = 4
_CHECK = 2


class WeightTransferError(RuntimeError):
    """What a rollout rank received is not what the actor sent (checksum, size or order)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def manifest_of(named_shapes: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> list[TensorSpec]:
    """[(name, full shape, dtype)] in the sender's iteration order -> the manifest both sides agree on."""
    return [TensorSpec(n, tuple(int(d) for d in s), str(dt).replace("torch.", "")) for n, s, dt in named_shapes]


def num_buckets(manifest: list[TensorSpec], bucket_bytes: int) -> int:
    total = sum(s.nbytes for s in manifest)
    return max(1, -(-total // bucket_bytes))


def wire_bytes(used: int) -> int:
    """Bytes a bucket holding `used` bytes occupies on the wire: whole 8-byte words (the last bucket is short)."""
    return -(-used // 8) * 8


def checksum(data: torch.Tensor) -> torch.Tensor:
    """[2] int64 of a uint8 tensor of whole words: the sums of its int32 words and of its odd-indexed words (a swap
    of two words changes the second)."""
    words = data.view(torch.int32)
    return torch.stack([words.sum(dtype=torch.int64), words[1::2].sum(dtype=torch.int64)])


class TransferGroup:
    """Rank 0 (the actor's sender) and the rollout ranks 1..N in one process group of their own."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = store  # keep the store alive as long as the group
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("weights", store), rank, world_size)
            self.device = device.current_device()
        else:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("weights", store), rank, world_size, timeout)
            self.device = torch.device("cpu")

    @classmethod
    def join(cls, addr: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0) -> TransferGroup:
        """Blocks until every rank has joined; rank 0 hosts the store on `port`, the one its process holds from
        common.ports.hold_free_port if it does."""
        store = tcp_store(addr, port, world_size, rank == 0, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
        backend = "nccl" if device.is_cuda_available() else "gloo"
        return cls(store, rank, world_size, backend, timeout_s)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()


def send_weights(
    group: TransferGroup,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    manifest: list[TensorSpec],
    *,
    version: int,
    bucket_bytes: int,
    tamper: Callable[[int, torch.Tensor], None] | None = None,
) -> dict[str, float]:
    """Rank 0: stream `named_tensors` (in manifest order) to every receiver. -> {"bytes", "seconds", "buckets"}.

    `tamper(bucket_index, bucket)` runs after the checksum and before the broadcast: tests corrupt a bucket with it.
    """
    start = time.perf_counter()
    bucket_bytes = _round_bucket(bucket_bytes)
    total = sum(s.nbytes for s in manifest)
    count = num_buckets(manifest, bucket_bytes)
    group.broadcast(torch.tensor([MAGIC, version, count, total], dtype=torch.int64, device=group.device))
    bucket = torch.zeros(bucket_bytes, dtype=torch.uint8, device=group.device)
    used, index = 0, 0

    def flush() -> None:
        nonlocal used, index
        wire = bucket[: wire_bytes(used)]  # only what is filled travels: a small model is not padded to a bucket
        wire[used:].zero_()
        check = checksum(wire)
        if tamper is not None:
            tamper(index, wire)
        group.broadcast(wire)
        group.broadcast(check)
        used, index = 0, index + 1

    specs = iter(manifest)
    for name, tensor in named_tensors:
        spec = next(specs, None)
        if spec is None or spec.name != name or tuple(tensor.shape) != spec.shape:
            raise WeightTransferError(
                f"sender: tensor {name} {tuple(tensor.shape)} does not match the manifest entry "
                f"{spec and (spec.name, spec.shape)}; the manifest is stale (rebuild the transfer group)"
            )
        data = tensor.detach().to(device=group.device, dtype=getattr(torch, spec.dtype)).contiguous().view(-1)
        data = data.view(torch.uint8)
        offset = 0
        while offset < data.numel():
            take = min(bucket_bytes - used, data.numel() - offset)
            bucket[used : used + take].copy_(data[offset : offset + take])
            used, offset = used + take, offset + take
            if used == bucket_bytes:
                flush()
        del data, tensor  # drop the gathered full tensor before the next gather
    if used:
        flush()
    if index != count:
        raise WeightTransferError(f"sender: sent {index} buckets, announced {count}")
    device.synchronize()
    return {"bytes": float(total), "seconds": time.perf_counter() - start, "buckets": float(count)}


class ReceivedWeights:
    """The receiving side of one transfer, as an iterator of (name, tensor); `version` is known after the header."""

    def __init__(self, group: TransferGroup, manifest: list[TensorSpec], *, bucket_bytes: int,
                 expect_after: int | None = None):
        self.group, self.manifest = group, manifest
        self.bucket_bytes = _round_bucket(bucket_bytes)
        header = torch.zeros(_HEADER, dtype=torch.int64, device=group.device)
        group.broadcast(header)
        magic, version, count, total = (int(x) for x in header.tolist())
        where = f"rollout transfer rank {group.rank}"
        if magic != MAGIC:
            raise WeightTransferError(f"{where}: the weight stream is out of step (header {header.tolist()})")
        if total != sum(s.nbytes for s in manifest) or count != num_buckets(manifest, self.bucket_bytes):
            raise WeightTransferError(
                f"{where}: version {version} announces {count} buckets / {total} bytes, the manifest needs "
                f"{num_buckets(manifest, self.bucket_bytes)} / {sum(s.nbytes for s in manifest)}; sender and "
                "receivers disagree on the model or the bucket size"
            )
        self.version, self.count, self.bytes = version, count, total
        self.buckets_checked = 0
        if expect_after is not None and version <= expect_after:
            self._drain(total)  # keep the stream in step for the next transfer
            raise WeightTransferError(f"{where}: version {version} is not newer than the current {expect_after}")

    def _drain(self, remaining: int) -> None:
        """Receive and discard the buckets holding the transfer's last `remaining` bytes: after a refused header or
        a bad bucket the sender still sends the rest, and the next transfer must start at its header."""
        bucket = torch.zeros(self.bucket_bytes, dtype=torch.uint8, device=self.group.device)
        check = torch.zeros(_CHECK, dtype=torch.int64, device=self.group.device)
        while remaining > 0:
            used = min(self.bucket_bytes, remaining)
            self.group.broadcast(bucket[: wire_bytes(used)])
            self.group.broadcast(check)
            remaining -= used

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        bucket = torch.zeros(self.bucket_bytes, dtype=torch.uint8, device=self.group.device)
        check = torch.zeros(_CHECK, dtype=torch.int64, device=self.group.device)
        remaining = self.bytes
        pos = self.bucket_bytes  # force a receive first

        def next_bucket() -> None:
            nonlocal pos, remaining
            used = min(self.bucket_bytes, remaining)
            wire = bucket[: wire_bytes(used)]
            self.group.broadcast(wire)
            self.group.broadcast(check)
            mine = checksum(wire)
            remaining -= used
            if not torch.equal(mine, check):
                self._drain(remaining)
                raise WeightTransferError(
                    f"rollout transfer rank {self.group.rank}: bucket {self.buckets_checked} of version "
                    f"{self.version} fails its checksum (got {mine.tolist()}, sender {check.tolist()}); this rank's "
                    "weights are now inconsistent and it must receive a full transfer before generating"
                )
            self.buckets_checked += 1
            pos = 0

        for spec in self.manifest:
            out = torch.empty(spec.nbytes, dtype=torch.uint8, device=self.group.device)
            filled = 0
            while filled < spec.nbytes:
                if pos == self.bucket_bytes:
                    next_bucket()
                take = min(self.bucket_bytes - pos, spec.nbytes - filled)
                out[filled : filled + take].copy_(bucket[pos : pos + take])
                filled, pos = filled + take, pos + take
            yield spec.name, out.view(getattr(torch, spec.dtype)).view(spec.shape)
        if self.buckets_checked != self.count:
            raise WeightTransferError(
                f"rollout transfer rank {self.group.rank}: got {self.buckets_checked} of {self.count} buckets"
            )


def _round_bucket(bucket_bytes: int) -> int:
    """Buckets hold whole 8-byte words (the checksum reads int32 words) and at least 1 KiB."""
    return max(1024, int(bucket_bytes) // 8 * 8)
