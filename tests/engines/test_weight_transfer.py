"""engines/weight_transfer.py between real processes over gloo: tensors spanning buckets and buckets holding several
tensors arrive bitwise equal with their version; a corrupted bucket, a stale version and a wrong manifest are caught."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from hybridflow.common.ports import find_free_port
from hybridflow.engines.weight_transfer import (
    ReceivedWeights,
    TransferGroup,
    WeightTransferError,
    manifest_of,
    send_weights,
)

BUCKET = 4096  # bytes: the 3000-element tensor spans three buckets, the small ones share one


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(3000, generator=g),
        "layer.bias": torch.randn(7, generator=g),
        "layer.scale": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "head.weight": torch.randn(50, 9, generator=g),
    }


def manifest():
    return manifest_of((n, tuple(t.shape), t.dtype) for n, t in tensors(0).items())


def flip_a_byte(index: int, bucket: torch.Tensor) -> None:
    if index == 1:
        bucket[17] ^= 0x10


def run(rank: int, port: int, world: int, results) -> None:
    group = TransferGroup.join("127.0.0.1", port, rank, world, timeout_s=60)
    if rank == 0:
        stats = send_weights(group, tensors(1).items(), manifest(), version=1, bucket_bytes=BUCKET)
        results.put(("sent", stats["buckets"], stats["bytes"]))
        send_weights(group, tensors(2).items(), manifest(), version=2, bucket_bytes=BUCKET, tamper=flip_a_byte)
        send_weights(group, tensors(3).items(), manifest(), version=3, bucket_bytes=BUCKET)
        send_weights(group, tensors(4).items(), manifest(), version=4, bucket_bytes=BUCKET)
        return
    first = ReceivedWeights(group, manifest(), bucket_bytes=BUCKET, expect_after=0)
    got = dict(first)
    same = all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in tensors(1).items())
    results.put(("first", rank, first.version, first.buckets_checked, same))
    second = ReceivedWeights(group, manifest(), bucket_bytes=BUCKET, expect_after=first.version)
    try:
        dict(second)
        results.put(("second", rank, "not detected"))
    except WeightTransferError as err:
        results.put(("second", rank, str(err)))
    try:  # version 3 is fine, but this receiver claims it already holds 5: a stale stream is refused
        ReceivedWeights(group, manifest(), bucket_bytes=BUCKET, expect_after=5)
        results.put(("third", rank, "not detected"))
    except WeightTransferError as err:
        results.put(("third", rank, str(err)))
    # both refusals drained the rest of their transfer: the next one starts in step
    fourth = ReceivedWeights(group, manifest(), bucket_bytes=BUCKET, expect_after=3)
    got = dict(fourth)
    results.put(("fourth", rank, fourth.version, all(torch.equal(got[n], t) for n, t in tensors(4).items())))


def test_buckets_arrive_verified_and_versioned():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, world = find_free_port(), 3
    procs = [ctx.Process(target=run, args=(r, port, world, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    out = [results.get(timeout=5) for _ in range(1 + 4 * (world - 1))]
    sent = next(o for o in out if o[0] == "sent")
    total = sum(t.numel() * t.element_size() for t in tensors(0).values())
    assert sent[2] == total and sent[1] == -(-total // BUCKET) >= 3
    for o in out:
        if o[0] == "first":
            assert o[2] == 1 and o[3] == sent[1] and o[4], o
        if o[0] == "second":
            assert "bucket 1 of version 2 fails its checksum" in o[2] and f"rank {o[1]}" in o[2], o
        if o[0] == "third":
            assert "version 3 is not newer than the current 5" in o[2], o
        if o[0] == "fourth":
            assert o[2] == 4 and o[3], o
    assert sum(o[0] == "fourth" for o in out) == world - 1


def test_sender_refuses_a_stale_manifest():
    group = TransferGroup.join("127.0.0.1", find_free_port(), 0, 1, timeout_s=10)
    wrong = dict(tensors(0))
    wrong["head.weight"] = torch.zeros(9, 50)
    try:
        send_weights(group, wrong.items(), manifest(), version=1, bucket_bytes=BUCKET)
    except WeightTransferError as err:
        assert "head.weight" in str(err) and "manifest" in str(err)
    else:
        raise AssertionError("a tensor of the wrong shape was sent")
