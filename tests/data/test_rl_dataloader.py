"""RLDataLoader: left padding, seeded per-epoch shuffling, exact resume from state_dict."""

from __future__ import annotations

import functools
import operator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data import DataConfigError, RLDataLoader, RLDataset
from hybridflow.engines.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rows = [
        {
            "data_source": "hybridflow/arithmetic",
            "prompt": [{"role": "user", "content": "1+" * (i % 7) + str(i)}],  # varied lengths
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(23)
    ]
    path = tmp_path_factory.mktemp("loader") / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return RLDataset(str(path), build_char_tokenizer(), max_prompt_length=64)


def ids_of(batch) -> list[int]:
    return [int(i) for i in batch.non_tensor_batch["index"]]


def test_left_padding_and_position_ids(dataset):
    pad = dataset.tokenizer.pad_token_id
    batch = next(iter(RLDataLoader(dataset, 8, shuffle=False)))
    ids, mask, pos = batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"]
    assert ids.shape == mask.shape == pos.shape and ids.shape[0] == 8
    assert ids.shape[1] == max(len(dataset[i]["input_ids"]) for i in range(8))
    for r in range(8):
        item = dataset[r]
        n = len(item["input_ids"])
        assert ids[r, -n:].tolist() == item["input_ids"].tolist()
        assert (ids[r, : ids.shape[1] - n] == pad).all() and mask[r].tolist() == [0] * (ids.shape[1] - n) + [1] * n
        assert pos[r, -n:].tolist() == list(range(n)) and (pos[r, : ids.shape[1] - n] == 0).all()
    assert batch.non_tensor_batch["ground_truth"][3] == "3"
    assert batch.non_tensor_batch["reward_model"][3] == {"style": "rule", "ground_truth": "3"}
    assert batch.non_tensor_batch["raw_prompt"][3] == dataset[3]["raw_prompt"]
    assert batch.non_tensor_batch["extra_info"][3] == {"index": 3}
    assert set(batch.non_tensor_batch) >= {"data_source", "ability", "index"}


def test_len_and_drop_last(dataset):
    assert len(RLDataLoader(dataset, 5)) == 4
    assert [len(b) for b in RLDataLoader(dataset, 5, drop_last=False, shuffle=False)] == [5, 5, 5, 5, 3]
    with pytest.raises(DataConfigError, match="batch_size=24 is larger than the dataset"):
        RLDataLoader(dataset, 24)


def test_seeded_shuffle_is_deterministic_and_differs_per_epoch(dataset):
    a, b, c = RLDataLoader(dataset, 5, seed=1), RLDataLoader(dataset, 5, seed=1), RLDataLoader(dataset, 5, seed=2)
    epoch0_a, epoch0_b, epoch0_c = [ids_of(x) for x in a], [ids_of(x) for x in b], [ids_of(x) for x in c]
    assert epoch0_a == epoch0_b and epoch0_a != epoch0_c
    flat = functools.reduce(operator.iadd, epoch0_a, [])
    assert len(set(flat)) == 20 and flat != sorted(flat)  # no row twice in an epoch, and actually shuffled
    epoch1_a = [ids_of(x) for x in a]  # iterating again continues with the next epoch
    assert epoch1_a != epoch0_a and a.epoch == 2
    assert torch.equal(next(iter(RLDataLoader(dataset, 5, seed=1))).batch["input_ids"],
                       RLDataLoader(dataset, 5, seed=1)._batch(a.epoch_order(0), 0).batch["input_ids"])


def test_resume_from_state_dict_yields_the_same_batches(dataset):
    reference = RLDataLoader(dataset, 5, seed=3)
    stream = reference.iter_batches()
    expected = [ids_of(next(stream)) for _ in range(11)]  # crosses two epoch boundaries (4 batches/epoch)

    for stop in (0, 2, 4, 6, 9):
        first = RLDataLoader(dataset, 5, seed=3)
        it = first.iter_batches()
        seen = [ids_of(next(it)) for _ in range(stop)]
        state = first.state_dict()
        resumed = RLDataLoader(dataset, 5, seed=3)
        resumed.load_state_dict(state)
        rest = resumed.iter_batches()
        seen += [ids_of(next(rest)) for _ in range(11 - stop)]
        assert seen == expected, f"resume after {stop} batches diverged"


def test_load_state_dict_rejects_other_settings(dataset):
    state = RLDataLoader(dataset, 5, seed=3).state_dict()
    with pytest.raises(DataConfigError, match="seed=3 but this loader has seed=4"):
        RLDataLoader(dataset, 5, seed=4).load_state_dict(state)
    with pytest.raises(DataConfigError, match="batch_size=5 but this loader has batch_size=4"):
        RLDataLoader(dataset, 4, seed=3).load_state_dict(state)
