"""DataProtoFuture: the result of a non-blocking group call, still sitting in Ray's object store.

``fut = wg.generate_sequences(batch)`` (registered with ``blocking=False``) returns at once. ``fut.get()`` waits and
collects like the blocking call would. Passing ``fut`` into a DP_COMPUTE_PROTO method of another group does not
materialise it in the driver: each rank of the consuming group receives a small `FutureChunk` (object references plus
its data-parallel slot), asks for the row count of every producing rank's output, works out which rows are its own
(padding to a multiple of its dp size exactly as pad_to_divisor would), and fetches only the outputs that hold them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.protocol import DataProto
from hybridflow.single_controller.errors import where


@dataclass
class FutureChunk:
    """Handed to one consuming rank in place of a DataProtoFuture argument; resolved inside that rank."""

    len_refs: list  # ray.ObjectRef[int | None], one per producing collector, in gather order
    data_refs: list  # ray.ObjectRef[DataProto]
    producer_ranks: list[int]
    dp_rank: int
    dp_size: int
    producer: str  # "group.method", for error messages
    producer_info: list[dict]

    def resolve(self) -> tuple[DataProto, int]:
        """-> (this rank's rows [chunk, ...], number of trailing padding rows among them)."""
        lens = self._get(self.len_refs)
        if any(n is None for n in lens):
            raise TypeError(f"the input future from {self.producer} did not produce DataProtos on every rank")
        total = sum(lens)
        if total == 0:
            raise ValueError(f"the input future from {self.producer} holds no rows; nothing to split")
        pad = (-total) % self.dp_size
        rows = (total + pad) // self.dp_size
        start, stop = self.dp_rank * rows, (self.dp_rank + 1) * rows
        # rows past `total` are padding: copies of rows 0, 1, ... (the rule of DataProto.pad_to_divisor)
        wanted = list(range(start, min(stop, total))) + [r % total for r in range(max(start, total), stop)]
        pad_rows = max(0, stop - max(start, total))
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        # consecutive runs of wanted rows that live in the same producer output
        runs: list[tuple[int, list[int]]] = []
        for r in wanted:
            src = _source_of(r, offsets)
            if not runs or runs[-1][0] != src:
                runs.append((src, []))
            runs[-1][1].append(r - offsets[src])
        needed = sorted({src for src, _ in runs})
        fetched = dict(
            zip(needed, self._get([self.data_refs[i] for i in needed], [self.producer_ranks[i] for i in needed]))
        )
        parts = [fetched[src][torch.tensor(idx, dtype=torch.long)] for src, idx in runs]
        return (parts[0] if len(parts) == 1 else DataProto.concat(parts)), pad_rows

    def _get(self, refs: list, ranks: list[int] | None = None) -> list:
        import ray  # only ever resolved inside a Ray worker

        ranks = ranks if ranks is not None else self.producer_ranks
        try:
            return ray.get(refs)
        except Exception as e:
            raise RuntimeError(
                f"an input future from {self.producer} failed (one of {[where(self.producer_info, r) for r in ranks]}):"
                f"\n{e}"
            ) from e


def _source_of(row: int, offsets: list[int]) -> int:
    # number of sources is small (the producer's dp size): linear scan is fine
    for i in range(len(offsets) - 1):
        if offsets[i] <= row < offsets[i + 1]:
            return i
    raise IndexError(row)


class DataProtoFuture:
    """The pending result of a non-blocking group call. ``get()`` -> what the blocking call would have returned."""

    def __init__(
        self,
        *,
        group: str,
        method: str,
        data_refs: Sequence[Any],
        ranks: Sequence[int],
        collect: Callable[[list], Any],
        len_refs: Sequence[Any] | None = None,
        timeout_s: float | None = None,
        rank_info: Sequence[dict] | None = None,
    ) -> None:
        self.group, self.method = group, method
        self._data_refs, self._ranks, self._collect = list(data_refs), list(ranks), collect
        self._len_refs = list(len_refs) if len_refs is not None else None
        self._timeout_s, self._rank_info = timeout_s, list(rank_info or [])
        self._value: Any = None
        self._has_value = False

    @classmethod
    def from_value(cls, value: Any, *, group: str = "local", method: str = "?") -> DataProtoFuture:
        """An already computed result (the local backend computes eagerly)."""
        fut = cls(group=group, method=method, data_refs=[], ranks=[], collect=lambda _: value)
        fut._value, fut._has_value = value, True
        return fut

    @property
    def is_ready_value(self) -> bool:
        return self._has_value

    def get(self, timeout_s: float | None = None) -> Any:
        """Wait (at most `timeout_s`, default: the group's call timeout) and collect."""
        if self._has_value:
            return self._value
        from hybridflow.single_controller.errors import wait_for

        outputs = wait_for(
            self._data_refs,
            self._ranks,
            group=self.group,
            method=self.method,
            timeout_s=self._timeout_s if timeout_s is None else timeout_s,
            rank_info=self._rank_info,
        )
        self._value, self._has_value = self._collect(outputs), True
        return self._value

    def chunk_for(self, dp_rank: int, dp_size: int) -> FutureChunk | DataProto:
        """What consuming data-parallel rank `dp_rank` of `dp_size` receives in place of this future."""
        if self._has_value:  # computed already (local backend): plain chunking
            value = self._value
            if not isinstance(value, DataProto):
                raise TypeError(
                    f"the future from {self.group}.{self.method} holds {type(value).__name__}, not a DataProto"
                )
            padded, _ = value.pad_to_divisor(dp_size)
            return padded.chunk(dp_size)[dp_rank]
        if self._len_refs is None:
            raise TypeError(
                f"the future from {self.group}.{self.method} cannot be split across ranks: only futures of "
                "DataProto-returning dispatch modes (DP_COMPUTE_PROTO, mesh-aware DP) can; call .get() first"
            )
        return FutureChunk(
            len_refs=self._len_refs,
            data_refs=self._data_refs,
            producer_ranks=self._ranks,
            dp_rank=dp_rank,
            dp_size=dp_size,
            producer=f"{self.group}.{self.method}",
            producer_info=self._rank_info,
        )

    def __repr__(self) -> str:
        state = "ready" if self._has_value else f"{len(self._data_refs)} pending outputs"
        return f"DataProtoFuture({self.group}.{self.method}, {state})"
