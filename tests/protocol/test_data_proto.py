"""DataProto: unit tests of every method, and hypothesis properties of the row algebra."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow.protocol import DataProto, DataProtoError


def make(n: int = 6, seq: int = 3) -> DataProto:
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.arange(n * seq).reshape(n, seq),
            "log_probs": torch.linspace(-1, 0, n * seq).reshape(n, seq),
            "mask": torch.arange(n) % 2 == 0,
        },
        non_tensors={"uid": [f"u{i}" for i in range(n)], "extra": [{"i": i, "xs": [i] * i} for i in range(n)]},
        meta_info={"temperature": 0.7},
    )


def assert_same(a: DataProto, b: DataProto) -> None:
    """Exact equality of columns (values, dtypes, shapes) and meta_info."""
    assert set(a.batch) == set(b.batch) and set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for k in a.batch:
        assert a.batch[k].dtype == b.batch[k].dtype, k
        assert a.batch[k].shape == b.batch[k].shape, k
        assert torch.equal(a.batch[k], b.batch[k]), k
    for k in a.non_tensor_batch:
        assert list(a.non_tensor_batch[k]) == list(b.non_tensor_batch[k]), k
    assert a.meta_info == b.meta_info


# ---------------------------------------------------------------------------------------------- construction
def test_construction_and_basic_properties():
    d = make(5)
    assert len(d) == d.batch_size == 5
    assert d.keys() == ["input_ids", "log_probs", "mask", "uid", "extra"]
    assert "uid" in d and "input_ids" in d and "nope" not in d
    assert d.non_tensor_batch["uid"].dtype == object
    assert "len=5" in repr(d)
    assert len(DataProto()) == 0
    only_objects = DataProto.from_dict(non_tensors={"x": np.array([1, 2, 3])})
    assert len(only_objects) == 3 and only_objects.non_tensor_batch["x"].dtype == object


def test_from_single_dict_splits_tensors_and_objects():
    d = DataProto.from_single_dict({"a": torch.zeros(2, 3), "b": ["x", "y"]}, meta_info={"m": 1})
    assert list(d.batch) == ["a"] and list(d.non_tensor_batch) == ["b"] and d.meta_info == {"m": 1}


def test_construction_errors_name_the_columns():
    with pytest.raises(DataProtoError, match=r"batch\['a'\]: 2.*batch\['b'\]: 3"):
        DataProto.from_dict({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(DataProtoError, match=r"non_tensor_batch\['s'\]: 1"):
        DataProto.from_dict({"a": torch.zeros(2)}, {"s": ["only one"]})
    with pytest.raises(DataProtoError, match=r"0-d tensor.*meta_info"):
        DataProto.from_dict({"a": torch.tensor(1.0)})
    with pytest.raises(DataProtoError, match="must be a list or numpy array"):
        DataProto.from_dict({"a": torch.zeros(2)}, {"s": "not a column"})
    with pytest.raises(DataProtoError, match=r"must be a torch\.Tensor"):
        DataProto(batch={"a": np.zeros(2)})


# ---------------------------------------------------------------------------------------------- indexing
def test_index_by_int_returns_a_row_dict():
    d = make(4)
    row = d[2]
    assert torch.equal(row["input_ids"], torch.tensor([6, 7, 8])) and row["uid"] == "u2"
    assert d[-1]["uid"] == "u3" and d[np.int64(1)]["uid"] == "u1"
    with pytest.raises(IndexError, match="out of range"):
        d[4]


def test_index_by_string_returns_the_column():
    d = make(3)
    assert d["input_ids"] is d.batch["input_ids"] and d["uid"] is d.non_tensor_batch["uid"]
    with pytest.raises(KeyError, match=r"unknown key.*'nope'.*tensors: \['input_ids'"):
        d["nope"]


@pytest.mark.parametrize(
    "item, rows",
    [
        (slice(1, 4), [1, 2, 3]),
        (slice(None, None, 2), [0, 2, 4]),
        (torch.tensor([4, 0, 0]), [4, 0, 0]),
        ([5, 1], [5, 1]),
        (np.array([3, -1]), [3, 5]),
        (torch.tensor([True, False, False, True, False, True]), [0, 3, 5]),
        ([True, False, False, False, False, False], [0]),
        ([], []),
    ],
)
def test_index_selects_rows_in_every_column(item, rows):
    d = make(6)
    out = d[item]
    assert len(out) == len(rows)
    assert torch.equal(out.batch["input_ids"], d.batch["input_ids"][torch.tensor(rows, dtype=torch.long)])
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in rows]
    assert out.meta_info == d.meta_info


def test_index_errors():
    d = make(4)
    with pytest.raises(DataProtoError, match=r"boolean mask has shape \(3,\), expected \(4,\)"):
        d[torch.tensor([True, False, True])]
    with pytest.raises(DataProtoError, match=r"dtype torch\.float32"):
        d[torch.tensor([0.0, 1.0])]
    with pytest.raises(IndexError):
        d[[0, 4]]


# ---------------------------------------------------------------------------------------------- columns
def test_select_and_unknown_keys():
    d = make(3)
    s = d.select(["input_ids"], ["uid"], ["temperature"])
    assert (
        list(s.batch) == ["input_ids"] and list(s.non_tensor_batch) == ["uid"] and s.meta_info == {"temperature": 0.7}
    )
    assert s.batch["input_ids"] is d.batch["input_ids"]  # shallow by default
    deep = d.select(["input_ids"], deepcopy=True)
    deep.batch["input_ids"][0, 0] = -5
    assert d.batch["input_ids"][0, 0] == 0
    assert set(d.select().keys()) == set(d.keys())
    with pytest.raises(KeyError, match=r"unknown key\(s\) \['nope'\]; tensors: \['input_ids', 'log_probs', 'mask'\]"):
        d.select(["nope"])
    with pytest.raises(KeyError, match=r"'ghost'.*non-tensors: \['extra', 'uid'\]"):
        d.select(non_tensor_keys=["ghost"])


def test_pop_removes_columns():
    d = make(3)
    popped = d.pop(["log_probs"], ["extra"], ["temperature"])
    assert list(popped.batch) == ["log_probs"] and list(popped.non_tensor_batch) == ["extra"]
    assert popped.meta_info == {"temperature": 0.7}
    assert d.keys() == ["input_ids", "mask", "uid"] and d.meta_info == {}
    with pytest.raises(KeyError, match="log_probs"):
        d.pop(["log_probs"])
    assert "input_ids" in d  # a failed pop removes nothing


def test_rename():
    d = make(3)
    assert d.rename("log_probs", "old_log_probs") is d
    assert "old_log_probs" in d.batch and "log_probs" not in d
    d.rename(["uid", "extra"], ["group_id", "info"])
    assert list(d.non_tensor_batch) == ["group_id", "info"]
    with pytest.raises(KeyError, match="'nope'"):
        d.rename("nope", "x")
    with pytest.raises(DataProtoError, match="exists already"):
        d.rename("input_ids", "mask")
    with pytest.raises(DataProtoError, match="as many new names"):
        d.rename(["input_ids"], ["a", "b"])


def test_union_adds_columns_and_rejects_conflicts():
    d = make(4)
    other = DataProto.from_dict(
        {"values": torch.ones(4, 3), "input_ids": d.batch["input_ids"].clone()},
        {"uid": list(d.non_tensor_batch["uid"])},
    )
    other.meta_info["step"] = 3
    assert d.union(other) is d
    assert "values" in d.batch and d.meta_info == {"temperature": 0.7, "step": 3}
    with pytest.raises(DataProtoError, match="union conflict on tensor 'values'"):
        d.union(DataProto.from_dict({"values": torch.zeros(4, 3)}))
    with pytest.raises(DataProtoError, match="union conflict on non-tensor column 'uid'"):
        d.union(DataProto.from_dict(non_tensors={"uid": ["a", "b", "c", "d"]}))
    with pytest.raises(DataProtoError, match=r"meta_info\['temperature'\]"):
        d.union(DataProto(meta_info={"temperature": 1.0}))
    with pytest.raises(DataProtoError, match="lengths 4 and 2"):
        d.union(make(2))
    # meta_info holding tensors/arrays compares by value
    DataProto(meta_info={"t": torch.ones(2)}).union(DataProto(meta_info={"t": torch.ones(2)}))


# ---------------------------------------------------------------------------------------------- row algebra
def test_concat_and_its_errors():
    d = make(6)
    out = DataProto.concat([d[:2], d[2:5], d[5:]])
    assert_same(out, d)
    with pytest.raises(DataProtoError, match="at least one"):
        DataProto.concat([])
    with pytest.raises(DataProtoError, match="item 1 has columns"):
        DataProto.concat([d, d.select(["input_ids"], ["uid"])])
    wide = DataProto.from_dict({k: v for k, v in d.batch.items()}, dict(d.non_tensor_batch))
    wide.batch["input_ids"] = torch.zeros(6, 5, dtype=torch.long)
    with pytest.raises(DataProtoError, match="pad to a common length"):
        DataProto.concat([d, wide])
    wide.batch["input_ids"] = d.batch["input_ids"].int()
    with pytest.raises(DataProtoError, match=r"torch\.int32 in item 1"):
        DataProto.concat([d, wide])


def test_chunk_split_and_errors():
    d = make(6)
    parts = d.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2] and list(parts[2].non_tensor_batch["uid"]) == ["u4", "u5"]
    assert [len(p) for p in d.split(4)] == [4, 2]
    with pytest.raises(DataProtoError, match=r"cannot split 6 rows into 4.*pad_to_divisor\(4\)"):
        d.chunk(4)
    with pytest.raises(DataProtoError, match="positive"):
        d.chunk(0)
    with pytest.raises(DataProtoError, match="positive"):
        d.split(0)
    empty = d[[]]
    assert [len(p) for p in empty.chunk(2)] == [0, 0]


def test_repeat_interleave_and_tiled():
    d = make(3)
    inter = d.repeat(2, interleave=True)
    assert list(inter.non_tensor_batch["uid"]) == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert torch.equal(inter.batch["input_ids"], d.batch["input_ids"].repeat_interleave(2, dim=0))
    tiled = d.repeat(2, interleave=False)
    assert list(tiled.non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u0", "u1", "u2"]


def test_reorder_in_place_and_errors():
    d = make(4)
    assert d.reorder([3, 1, 0, 2]) is d
    assert list(d.non_tensor_batch["uid"]) == ["u3", "u1", "u0", "u2"]
    assert torch.equal(d.batch["input_ids"][0], torch.tensor([9, 10, 11]))
    with pytest.raises(DataProtoError, match="needs 4 indices"):
        d.reorder([0, 1])


def test_pad_to_divisor_and_unpad():
    d = make(5)
    padded, pad = d.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    assert list(padded.non_tensor_batch["uid"][5:]) == ["u0", "u1", "u2"]  # copies of the first rows
    assert_same(padded.unpad(pad), d)
    same, zero = d.pad_to_divisor(5)
    assert zero == 0 and same is d and d.unpad(0) is d
    with pytest.raises(DataProtoError, match="positive"):
        d.pad_to_divisor(0)
    assert d[[]].pad_to_divisor(3)[1] == 0  # zero rows divide by anything
    # more padding than rows wraps around
    small, pad = make(2).pad_to_divisor(7)
    assert pad == 5 and list(small.non_tensor_batch["uid"]) == ["u0", "u1", "u0", "u1", "u0", "u1", "u0"]


def test_make_iterator_epochs_shuffle_and_seed():
    d = make(8)
    plain = list(d.make_iterator(mini_batch_size=4, epochs=2))
    assert len(plain) == 4
    assert [list(m.non_tensor_batch["uid"]) for m in plain[:2]] == [
        [f"u{i}" for i in range(4)],
        [f"u{i}" for i in range(4, 8)],
    ]

    def order(seed):
        return [u for mb in d.make_iterator(2, epochs=2, shuffle=True, seed=seed) for u in mb.non_tensor_batch["uid"]]

    a, b, c = order(1), order(1), order(2)
    assert a == b and a != c
    assert sorted(a[:8]) == sorted(f"u{i}" for i in range(8)) and sorted(a[8:]) == sorted(a[:8])
    assert a[:8] != a[8:]  # reshuffled between epochs (seed 1, 8 rows: checked to differ)
    for mb in d.make_iterator(2, shuffle=True, seed=3):  # rows stay aligned across columns
        for i in range(len(mb)):
            n = int(mb.non_tensor_batch["uid"][i][1:])
            assert mb.batch["input_ids"][i, 0] == 3 * n and mb.non_tensor_batch["extra"][i]["i"] == n
    with pytest.raises(DataProtoError, match="must divide the batch of 8"):
        next(d.make_iterator(3))


def test_to_moves_in_place():
    d = make(2)
    assert d.to("cpu") is d and d.batch["input_ids"].device.type == "cpu"
    d.to(torch.device("meta"))
    assert all(v.device.type == "meta" for v in d.batch.values())


def test_save_and_load(tmp_path):
    d = make(4)
    d.batch["bf16"] = torch.randn(4, 2).bfloat16()
    d.save_to_disk(tmp_path / "batch.pkl")
    assert_same(DataProto.load_from_disk(tmp_path / "batch.pkl"), d)
    with open(tmp_path / "other.pkl", "wb") as f:
        pickle.dump({"x": 1}, f)
    with pytest.raises(DataProtoError, match="does not hold a DataProto"):
        DataProto.load_from_disk(tmp_path / "other.pkl")


# ---------------------------------------------------------------------------------------------- transport
class Opaque:
    """An arbitrary Python object for a non-tensor column."""

    def __init__(self, payload):
        self.payload = payload

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.payload == self.payload


def transport_batch() -> DataProto:
    g = torch.Generator().manual_seed(0)
    return DataProto.from_dict(
        tensors={
            "f32": torch.randn(4, 3, generator=g),
            "bf16": torch.randn(4, 3, generator=g).bfloat16(),
            "i64": torch.randint(-(2**62), 2**62, (4, 5), generator=g),
            "bool": torch.rand(4, generator=g) > 0.5,
            "non_contiguous": torch.randn(3, 4, generator=g).t(),
        },
        non_tensors={
            "obj": [Opaque({"a": [1, 2]}), Opaque(None), Opaque("s"), Opaque((1, 2.5))],
            "nested": [[1, [2]], {"k": "v"}, None, np.arange(3)],
        },
        meta_info={"step": 7, "tensor": torch.ones(2)},
    )


def assert_transport_exact(a: DataProto, b: DataProto) -> None:
    for k in a.batch:
        assert b.batch[k].dtype == a.batch[k].dtype, k
        assert torch.equal(
            b.batch[k].view(torch.uint8) if b.batch[k].dtype == torch.bool else b.batch[k],
            a.batch[k].view(torch.uint8) if a.batch[k].dtype == torch.bool else a.batch[k],
        ), k
    assert list(b.non_tensor_batch["obj"]) == list(a.non_tensor_batch["obj"])
    assert b.non_tensor_batch["nested"][:3].tolist() == a.non_tensor_batch["nested"][:3].tolist()
    assert np.array_equal(b.non_tensor_batch["nested"][3], a.non_tensor_batch["nested"][3])
    assert b.meta_info["step"] == 7 and torch.equal(b.meta_info["tensor"], torch.ones(2))


@pytest.mark.parametrize("protocol", [2, 5])
def test_pickle_round_trip_is_exact(protocol):
    d = transport_batch()
    back = pickle.loads(pickle.dumps(d, protocol=protocol))
    assert_transport_exact(d, back)
    back.batch["f32"][0, 0] = 123.0  # the copy is independent of the original
    assert d.batch["f32"][0, 0] != 123.0


def test_pickle_protocol5_moves_tensor_storage_out_of_band():
    d = DataProto.from_dict({"x": torch.arange(1000, dtype=torch.int64), "h": torch.zeros(1000).bfloat16()})
    buffers = []
    data = pickle.dumps(d, protocol=5, buffer_callback=buffers.append)
    assert sum(memoryview(b).nbytes for b in buffers) == 8000 + 2000
    assert len(data) < 2000  # the storage is not in the in-band stream
    back = pickle.loads(data, buffers=buffers)
    assert torch.equal(back.batch["x"], d.batch["x"]) and back.batch["h"].dtype == torch.bfloat16


def test_ray_object_store_round_trip(ray_session):
    ray = ray_session
    # Ray workers cannot import pytest's test modules by name: ship this module's classes (Opaque) by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    d = transport_batch()
    d.batch["big"] = torch.arange(64 * 2048, dtype=torch.int64).reshape(64, 2048)  # > 100 KB: lives in shared memory
    back = ray.get(ray.put(d))
    assert_transport_exact(d, back)
    assert torch.equal(back.batch["big"], d.batch["big"])
    back.batch["big"] += 1  # tensors from the store must be writable without touching the stored object
    assert torch.equal(ray.get(ray.put(d)).batch["big"], d.batch["big"])

    @ray.remote
    def add_column(batch: DataProto) -> DataProto:
        batch.batch["doubled"] = batch.batch["f32"] * 2
        return batch

    out = ray.get(add_column.remote(d))
    assert_transport_exact(d, out)
    assert torch.equal(out.batch["doubled"], d.batch["f32"] * 2)


# ---------------------------------------------------------------------------------------------- properties
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw, min_rows: int = 0, max_rows: int = 12):
    n = draw(st.integers(min_rows, max_rows))
    seq = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    return DataProto.from_dict(
        {
            "ids": torch.randint(0, 100, (n, seq), generator=g),
            "w": torch.randn(n, generator=g).bfloat16(),
            "flag": torch.rand(n, seq, generator=g) > 0.5,
        },
        {"row": [(seed, i) for i in range(n)]},
        {"seed": seed},
    )


@PROPS
@given(batches(min_rows=1), st.integers(1, 6))
def test_concat_of_chunks_is_identity(d, k):
    padded, pad = d.pad_to_divisor(k)
    parts = padded.chunk(k)
    assert len(parts) == k and len({len(p) for p in parts}) == 1
    assert_same(DataProto.concat(parts).unpad(pad), d)


@PROPS
@given(batches(min_rows=1), st.integers(1, 5))
def test_concat_of_splits_is_identity(d, size):
    assert_same(DataProto.concat(d.split(size)), d)


@PROPS
@given(batches(), st.integers(1, 4))
def test_repeat_round_trips(d, n):
    inter = d.repeat(n, interleave=True)
    tiled = d.repeat(n, interleave=False)
    assert len(inter) == len(tiled) == n * len(d)
    assert_same(inter[list(range(0, len(inter), n))], d)  # every n-th row of an interleaved repeat
    for j in range(n):
        assert_same(tiled[j * len(d) : (j + 1) * len(d)], d)


@PROPS
@given(batches(), st.randoms(use_true_random=False))
def test_reorder_then_inverse_is_identity(d, rnd):
    perm = list(range(len(d)))
    rnd.shuffle(perm)
    inverse = torch.argsort(torch.tensor(perm, dtype=torch.long))
    original = d.select()
    d.reorder(perm)
    assert list(d.non_tensor_batch["row"]) == [original.non_tensor_batch["row"][i] for i in perm]
    assert_same(d.reorder(inverse), original)


@PROPS
@given(batches(min_rows=1), st.data())
def test_index_by_mask_equals_index_by_positions(d, data):
    mask = data.draw(st.lists(st.booleans(), min_size=len(d), max_size=len(d)))
    positions = [i for i, m in enumerate(mask) if m]
    assert_same(d[torch.tensor(mask)], d[positions])
    assert_same(d[torch.tensor(positions, dtype=torch.long)], d[positions])


@PROPS
@given(batches(min_rows=1))
def test_union_semantics(d):
    left = d.select(["ids"], [])
    right = d.select(["w", "flag"], ["row"])
    assert_same(left.union(right), d)  # disjoint columns: union is the merge
    assert_same(d.select().union(d), d)  # union with itself is the identity
    changed = d.select(["ids"], deepcopy=True)
    changed.batch["ids"][0, 0] += 1
    with pytest.raises(DataProtoError, match="union conflict"):
        d.select().union(changed)


@PROPS
@given(batches())
def test_pickle_round_trip_property(d):
    assert_same(pickle.loads(pickle.dumps(d, protocol=5)), d)
