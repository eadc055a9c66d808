"""RLDataLoader: seeded, resumable batches of left-padded prompts as DataProto.

Order: epoch ``e`` visits the rows in ``permutation(seed, e)`` (numpy's PCG64 seeded with ``[seed, e]``, stable across
platforms and numpy versions) or in file order when ``shuffle=False``. The position is the pair
(epoch, batches already yielded in that epoch); ``state_dict()`` saves it and ``load_state_dict()`` restores it, so a
resumed run sees exactly the batches an uninterrupted run would have seen next.

``for batch in loader`` yields the rest of the current epoch and then moves to the next epoch, so iterating again
continues with the next epoch; ``loader.iter_batches()`` never stops (it walks epoch after epoch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from hybridflow.data.dataset import RLDataset
from hybridflow.data.schema import DataConfigError
from hybridflow.protocol import DataProto

__all__ = ["RLDataLoader", "collate_prompts"]

_NON_TENSOR_KEYS = ("data_source", "raw_prompt", "ability", "reward_model", "ground_truth", "extra_info", "index",
                    "agent_name")


def collate_prompts(rows: list[dict[str, Any]], pad_token_id: int, *, return_raw_chat: bool = True) -> DataProto:
    """Rows from ``RLDataset.__getitem__`` -> one DataProto in the rollout input layout.

    ``input_ids [B, P]`` left-padded with ``pad_token_id`` to the longest prompt P, ``attention_mask [B, P]``,
    ``position_ids [B, P]`` (= cumsum(mask) - 1, clipped at 0 on the padding); the row fields as non-tensor columns
    (``raw_prompt``, the chat messages, only with return_raw_chat: veRL's data.return_raw_chat).
    """
    longest = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, longest - n :] = r["input_ids"]
        attention_mask[i, longest - n :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    non_tensors = {k: [r.get(k) for r in rows] for k in _NON_TENSOR_KEYS if return_raw_chat or k != "raw_prompt"}
    return DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}, non_tensors
    )


class RLDataLoader:
    """Batches of ``batch_size`` prompts from an RLDataset, as DataProto (see ``collate_prompts`` for the layout)."""

    def __init__(
        self, dataset: RLDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
        return_raw_chat: bool = True,
    ) -> None:
        if batch_size < 1:
            raise DataConfigError(f"{dataset.name} loader: batch_size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise DataConfigError(
                f"{dataset.name} loader: batch_size={batch_size} is larger than the dataset ({len(dataset)} rows "
                "after filtering), so drop_last=True leaves no batch; lower the batch size or add data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.return_raw_chat = return_raw_chat
        self.pad_token_id = int(dataset.tokenizer.pad_token_id)
        self.epoch = 0
        self.batches_done = 0  # batches already yielded in the current epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The row order of `epoch` (a permutation of range(len(dataset)))."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(n)

    def _batch(self, order: np.ndarray, b: int) -> DataProto:
        rows = [self.dataset[int(i)] for i in order[b * self.batch_size : (b + 1) * self.batch_size]]
        batch = collate_prompts(rows, self.pad_token_id, return_raw_chat=self.return_raw_chat)
        batch.meta_info.update({"epoch": self.epoch, "batch_in_epoch": b})
        return batch

    def __iter__(self) -> Iterator[DataProto]:
        """The remaining batches of the current epoch; afterwards the loader stands at the start of the next one."""
        order = self.epoch_order(self.epoch)
        while self.batches_done < len(self):
            batch = self._batch(order, self.batches_done)
            # Advance before yielding: a state_dict() taken while the caller holds this batch resumes after it.
            self.batches_done += 1
            yield batch
        self.epoch += 1
        self.batches_done = 0

    def iter_batches(self) -> Iterator[DataProto]:
        """Batches forever, epoch after epoch."""
        while True:
            yield from self

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_rows": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "shuffle", "batch_size", "num_rows"):
            mine = len(self.dataset) if key == "num_rows" else getattr(self, key)
            if key in state and state[key] != mine:
                raise DataConfigError(
                    f"{self.dataset.name} loader: the saved position was taken with {key}={state[key]!r} but this "
                    f"loader has {key}={mine!r}; resuming would not reproduce the batch order - use the same data and "
                    "data settings as the checkpointed run"
                )
        if not 0 <= int(state["batches_done"]) <= len(self):
            raise DataConfigError(
                f"{self.dataset.name} loader: saved position batches_done={state['batches_done']} is outside an "
                f"epoch of {len(self)} batches"
            )
        self.epoch = int(state["epoch"])
        self.batches_done = int(state["batches_done"])
        if self.batches_done == len(self):  # saved right after the last batch of an epoch
            self.epoch, self.batches_done = self.epoch + 1, 0
