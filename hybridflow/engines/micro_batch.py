"""Micro-batching without padding waste: strip rows to their real tokens, bucket them by length, pad per bucket.

Rows follow the layout of ``hybridflow/engines/rollout/base.py``: a left-padded prompt then a right-padded response,
so each row's real tokens (``attention_mask == 1``) are one contiguous span ``[start, end)``. A micro-batch is a
group of rows; it is computed as ``[rows, longest span in the group]`` with the short spans right-padded. Under a
causal mask right-padding cannot change the real tokens' outputs, so no attention mask is needed and the results
equal the padded computation. Grouping rows of similar length (sorted order) keeps the padding small;
`padding_stats` measures it. A packed engine (packing.py) has no padding to save: `packed_micro_batches` bounds each
group's summed length instead, in as few groups as fit.

Every rank must run the same number of micro-batches (each forward/backward is a collective under FSDP), so the
token-budget splitter takes a ``num_micro_batches`` to reach, which the engine all-reduces (max) first.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Bucket",
    "build_bucket",
    "fixed_size_micro_batches",
    "packed_micro_batches",
    "padding_stats",
    "real_token_spans",
    "split_to_count",
    "token_budget_micro_batches",
]


def real_token_spans(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_mask [B, T]`` -> ``(starts [B], ends [B])`` of each row's real tokens, ``end`` exclusive.

    Raises if a row's real tokens are not contiguous (the left-pad prompt / right-pad response layout).
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, seq], got shape {tuple(attention_mask.shape)}")
    if attention_mask.device.type == "cpu" and attention_mask.shape[1] > 0:
        # the same in numpy: a few small torch ops cost ~5 us each in dispatch alone, and each of a step's forward
        # passes asks this several times (planning, packing, shared prompts)
        mask = attention_mask.numpy(force=True).astype(bool, copy=False)
        counts = mask.sum(axis=1)
        starts = mask.argmax(axis=1)  # the first real token (argmax of booleans: the first True)
        ends = mask.shape[1] - mask[:, ::-1].argmax(axis=1)
        empty, holes = (counts == 0).nonzero()[0], (ends - starts != counts).nonzero()[0]
        starts, ends = torch.from_numpy(starts), torch.from_numpy(ends)
    else:
        mask = attention_mask.bool()
        seq = mask.shape[1]
        counts = mask.sum(dim=1)
        ar = torch.arange(seq, device=mask.device)
        starts = torch.where(mask, ar, seq).min(dim=1).values
        ends = torch.where(mask, ar, -1).max(dim=1).values + 1
        empty = (counts == 0).nonzero().flatten().tolist()
        holes = ((ends - starts) != counts).nonzero().flatten().tolist()
    if len(empty):
        raise ValueError(f"row {int(empty[0])} has no real tokens (attention_mask all zero); drop empty rows "
                         "before the engine")
    if len(holes):
        raise ValueError(
            f"row {int(holes[0])}: attention_mask has zeros between real tokens; the engine expects left-padded "
            "prompts followed by right-padded responses (rollout/base.py). Mask tokens out of the loss with "
            "response_mask instead of attention_mask"
        )
    return starts, ends


def fixed_size_micro_batches(lengths: Sequence[int], micro_batch_size: int, sort: bool = True) -> list[list[int]]:
    """Groups of `micro_batch_size` row indices; with `sort`, rows of similar length share a group."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    order = _longest_first(lengths) if sort else list(range(len(lengths)))
    return [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]


def token_budget_micro_batches(
    lengths: Sequence[int],
    max_tokens: int,
    num_micro_batches: int | None = None,
    max_padding_ratio: float = 0.1,
) -> list[list[int]]:
    """Groups of row indices whose padded size ``rows * longest`` stays within `max_tokens`.

    Rows are sorted longest first and cut into the fewest groups that fit the budget, placing the cuts where they
    leave the least padding (a row longer than the budget gets a group of its own). While padding is more than
    `max_padding_ratio` of the computed tokens, the group whose best cut saves the most padding is cut once more.
    With `num_micro_batches` the groups are cut until there are exactly that many; it must be >= the count found
    above and <= the number of rows.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_micro_batch must be positive, got {max_tokens}")
    order = _longest_first(lengths)
    sorted_lens = [int(lengths[i]) for i in order]
    groups = [[order[i] for i in range(lo, hi)] for lo, hi in _fewest_groups(sorted_lens, max_tokens)]
    while len(groups) < len(lengths) and padding_stats(lengths, groups)["padding_waste"] > max_padding_ratio:
        _cut_best(groups, lengths)
    return groups if num_micro_batches is None else split_to_count(groups, lengths, num_micro_batches)


def split_to_count(groups: list[list[int]], lengths: Sequence[int], num_micro_batches: int) -> list[list[int]]:
    """Cut groups (each longest-first) where it saves the most padding until there are `num_micro_batches`.

    Used to give every data-parallel rank the same micro-batch count; needs ``len(groups) <= count <= rows``.
    """
    rows = sum(len(g) for g in groups)
    if not len(groups) <= num_micro_batches <= rows:
        raise ValueError(
            f"cannot split {rows} rows into {num_micro_batches} micro-batches (this rank needs {len(groups)}); "
            "every data-parallel rank must hold the same number of rows"
        )
    groups = [list(g) for g in groups]
    while len(groups) < num_micro_batches:
        _cut_best(groups, lengths)
    return groups


def packed_micro_batches(
    lengths: Sequence[int], max_tokens: int, num_micro_batches: int | None = None
) -> list[list[int]]:
    """Groups of row indices for a packed engine (packing.py): each group's summed length stays within `max_tokens`.

    A packed micro-batch has no padding, so the only thing a cut changes is how many (and how small) the
    micro-batches are: this takes the fewest groups that fit (a row longer than the budget gets a group of its own),
    or exactly `num_micro_batches` (>= that count, <= the rows), with the tokens spread evenly over them (rows longest
    first, each to the group holding the fewest tokens so far).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_micro_batch must be positive, got {max_tokens}")
    n = len(lengths)
    if n == 0:
        return []
    order = _longest_first(lengths)
    count = min(n, max(1, -(-sum(int(length) for length in lengths) // max_tokens)))
    while True:
        groups = _spread(order, lengths, count)
        fits = all(len(g) == 1 or sum(int(lengths[i]) for i in g) <= max_tokens for g in groups)
        if fits or count == n:
            break
        count += 1
    if num_micro_batches is None or num_micro_batches == count:
        return groups
    if not count <= num_micro_batches <= n:
        raise ValueError(
            f"cannot split {n} rows into {num_micro_batches} micro-batches (this rank needs {count}); "
            "every data-parallel rank must hold the same number of rows"
        )
    return _spread(order, lengths, num_micro_batches)


def _spread(order: list[int], lengths: Sequence[int], count: int) -> list[list[int]]:
    """Rows (longest first) dealt to `count` groups, each to the one with the fewest tokens (ties: the lower index)."""
    heap = [(0, k) for k in range(count)]
    groups: list[list[int]] = [[] for _ in range(count)]
    for i in order:
        tokens, k = heapq.heappop(heap)
        groups[k].append(i)
        heapq.heappush(heap, (tokens + int(lengths[i]), k))
    return groups


def _fewest_groups(sorted_lens: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """Cut a longest-first list into the fewest budget-respecting runs ``[lo, hi)``, then the least padding.

    Dynamic programming from the end: best[i] = (groups, padded tokens) for rows i..n-1. A run starting at i is padded
    to sorted_lens[i], so its size is bounded by max_tokens // sorted_lens[i] and the work is O(rows * run size).
    """
    n = len(sorted_lens)
    best: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    cut = [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        best_i, cut_i = None, i + 1
        longest = max(1, max_tokens // sorted_lens[i])
        for j in range(i + 1, min(n, i + longest) + 1):
            groups, padded = best[j]
            candidate = (groups + 1, padded + (j - i) * sorted_lens[i])
            if best_i is None or candidate < best_i:
                best_i, cut_i = candidate, j
        best[i], cut[i] = best_i, cut_i
    runs, i = [], 0
    while i < n:
        runs.append((i, cut[i]))
        i = cut[i]
    return runs


def _cut_best(groups: list[list[int]], lengths: Sequence[int]) -> None:
    """Cut (in place) the group, at the point, that removes the most padded tokens; groups are longest-first."""
    best = None
    for k, g in enumerate(groups):
        if len(g) < 2:
            continue
        top = int(lengths[g[0]])
        for c in range(1, len(g)):
            # rows c.. were padded to `top`; after the cut they are padded to lengths[g[c]]
            saved = (len(g) - c) * (top - int(lengths[g[c]]))
            if best is None or saved > best[0]:
                best = (saved, k, c)
    if best is None:
        raise ValueError("cannot cut further: every micro-batch already holds a single row")
    _, k, c = best
    groups[k : k + 1] = [groups[k][:c], groups[k][c:]]


def padding_stats(
    lengths: Sequence[int], groups: Sequence[Sequence[int]], pad_to: int | None = None
) -> dict[str, float]:
    """Computed vs real tokens when each group is padded to its longest row (or to `pad_to`: the plain layout).

    Returns ``real_tokens``, ``computed_tokens``, ``padding_tokens`` and ``padding_waste`` (padding / computed).
    """
    real = sum(int(lengths[i]) for g in groups for i in g)
    computed = sum(len(g) * (pad_to or max(int(lengths[i]) for i in g)) for g in groups if len(g))
    return {
        "real_tokens": float(real),
        "computed_tokens": float(computed),
        "padding_tokens": float(computed - real),
        "padding_waste": (computed - real) / computed if computed else 0.0,
    }


def _longest_first(lengths: Sequence[int]) -> list[int]:
    # Stable sort: equal lengths keep their input order, so the grouping is deterministic.
    return sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))


@dataclass
class Bucket:
    """One micro-batch in compute layout.

    ``input_ids [b, L]`` / ``position_ids [b, L]``: the rows' real tokens, right-padded to the longest (L);
    ``attention_mask [b, L]`` or None (None: causal only, the stripped layout);
    ``select_rows [N]``, ``select_cols [N]``: the positions whose hidden state predicts a response token
    (response token t of a row sits at position ``P + t`` of the original layout and is predicted from ``P - 1 + t``);
    ``target_ids [N]``: those response tokens; ``out_rows [N]``, ``out_cols [N]``: where the N results go in the
    ``[b, R]`` output (row within the micro-batch, response index t).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    select_rows: torch.Tensor
    select_cols: torch.Tensor
    target_ids: torch.Tensor
    out_rows: torch.Tensor
    out_cols: torch.Tensor


def build_bucket(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    remove_padding: bool = True,
    pad_token_id: int = 0,
    width_multiple: int = 1,
) -> Bucket:
    """Turn padded rows ``[b, P+R]`` (one micro-batch, rollout layout) into a `Bucket`.

    With `remove_padding`, rows are stripped to their real tokens; otherwise they stay padded and the attention mask
    is kept (the plain HF computation, used as the reference and to measure the waste). Stripped rows are padded
    on the right to a multiple of `width_multiple` columns (batch_invariant.py: whole groups of rows per matmul).
    """
    b, seq = input_ids.shape
    prompt_len = seq - response_length
    if prompt_len < 1:
        raise ValueError(f"input_ids has {seq} columns but responses have {response_length}: no prompt token left")
    starts, ends = real_token_spans(attention_mask)
    resp_lens = (ends - prompt_len).clamp(min=0, max=response_length)
    out_rows = torch.repeat_interleave(torch.arange(b, device=input_ids.device), resp_lens)
    # response index t of each selected token: 0..resp_len-1 per row
    row_offsets = torch.cumsum(resp_lens, 0) - resp_lens
    out_cols = torch.arange(int(resp_lens.sum()), device=input_ids.device) - torch.repeat_interleave(
        row_offsets, resp_lens
    )
    target_ids = input_ids[out_rows, prompt_len + out_cols]
    if not remove_padding:
        return Bucket(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            select_rows=out_rows,
            select_cols=prompt_len - 1 + out_cols,
            target_ids=target_ids,
            out_rows=out_rows,
            out_cols=out_cols,
        )
    lens = ends - starts
    width = -(-int(lens.max()) // width_multiple) * width_multiple
    cols = torch.arange(width, device=input_ids.device)
    src = (starts[:, None] + cols[None, :]).clamp(max=seq - 1)
    real = cols[None, :] < lens[:, None]
    ids = torch.where(real, input_ids.gather(1, src), torch.full_like(src, pad_token_id))
    # Padding positions only need to be valid indices: causal attention keeps them from touching real tokens.
    pos = torch.where(real, position_ids.gather(1, src), torch.zeros_like(src))
    return Bucket(
        input_ids=ids,
        position_ids=pos,
        attention_mask=None,
        select_rows=out_rows,
        select_cols=prompt_len - 1 + out_cols - starts[out_rows],
        target_ids=target_ids,
        out_rows=out_rows,
        out_cols=out_cols,
    )
