"""Length bucketing, token-budget and packed micro-batching (hybridflow/engines/micro_batch.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.engines import micro_batch as mb

# row lengths, a token budget, and how many micro-batches beyond the natural count to force
budget_cases = given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    budget=st.integers(16, 1024),
    extra=st.integers(0, 5),
)


def rollout_mask(prompt_lens, resp_lens, prompt_len, response_len) -> torch.Tensor:
    mask = torch.zeros(len(prompt_lens), prompt_len + response_len, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        mask[i, prompt_len - p : prompt_len + r] = 1
    return mask


def test_real_token_spans_and_layout_errors():
    mask = rollout_mask([3, 1, 4], [2, 5, 0], prompt_len=4, response_len=5)
    starts, ends = mb.real_token_spans(mask)
    assert starts.tolist() == [1, 3, 0] and ends.tolist() == [6, 9, 4]
    holed = mask.clone()
    holed[1, 5] = 0
    with pytest.raises(ValueError, match="row 1: attention_mask has zeros between real tokens"):
        mb.real_token_spans(holed)
    with pytest.raises(ValueError, match="row 0 has no real tokens"):
        mb.real_token_spans(torch.zeros(1, 4, dtype=torch.long))


def assert_partition(groups, rows: int) -> None:
    """Every row in exactly one group."""
    assert sorted(i for g in groups for i in g) == list(range(rows))


def assert_forced_counts(splitter, lengths, budget, wanted: int) -> None:
    """`splitter` forced to `wanted` groups (at most one per row) gives that many, none empty, every row once."""
    target = min(len(lengths), wanted)
    forced = splitter(lengths, budget, num_micro_batches=target)
    assert len(forced) == target and all(forced)
    assert_partition(forced, len(lengths))


@settings(max_examples=60, deadline=None)
@budget_cases
def test_token_budget_groups_cover_every_row_once_and_respect_the_budget(lengths, budget, extra):
    natural = mb.token_budget_micro_batches(lengths, budget)
    assert_partition(natural, len(lengths))
    for g in natural:
        # Only a row longer than the whole budget may exceed it, and then it is alone.
        assert len(g) * max(lengths[i] for i in g) <= budget or len(g) == 1
    assert_forced_counts(mb.token_budget_micro_batches, lengths, budget, len(natural) + extra)


def test_forced_count_beyond_the_rows_is_an_error():
    with pytest.raises(ValueError, match="same number of rows"):
        mb.token_budget_micro_batches([5, 5], 100, num_micro_batches=3)


@settings(max_examples=60, deadline=None)
@budget_cases
def test_packed_groups_bound_the_summed_length_in_as_few_groups_as_fit(lengths, budget, extra):
    natural = mb.packed_micro_batches(lengths, budget)
    assert_partition(natural, len(lengths))
    for g in natural:
        assert sum(lengths[i] for i in g) <= budget or len(g) == 1
    # no fewer groups could hold the tokens
    assert len(natural) >= min(-(-sum(lengths) // budget), len(lengths))
    if max(lengths) < budget:
        # a row goes to the least-filled group, which holds <= total / groups: so total / (budget - longest) groups fit
        assert len(natural) <= max(1, -(-sum(lengths) // (budget - max(lengths))))
    assert_forced_counts(mb.packed_micro_batches, lengths, budget, len(natural) + extra)


def test_packed_groups_are_fewer_than_padding_cut_groups_and_even():
    """16 GRPO rows of 40-100 tokens under a 4096 budget: one packed micro-batch (the padding-based splitter cuts
    them by length, though a packed micro-batch has no padding); forced to 4, each holds about a quarter."""
    lengths = [40 + 4 * i for i in range(16)]
    assert mb.packed_micro_batches(lengths, 4096) == [sorted(range(16), key=lambda i: -lengths[i])]
    assert len(mb.token_budget_micro_batches(lengths, 4096)) > 1
    forced = mb.packed_micro_batches(lengths, 4096, num_micro_batches=4)
    sums = [sum(lengths[i] for i in g) for g in forced]
    assert max(sums) - min(sums) <= max(lengths) - min(lengths)
    with pytest.raises(ValueError, match="same number of rows"):
        mb.packed_micro_batches([5, 5], 100, num_micro_batches=3)
    with pytest.raises(ValueError, match="must be positive"):
        mb.packed_micro_batches([5], 0)


def test_padding_waste_is_small_when_responses_vary_4x():
    """64 rows, prompts 16-64 tokens, responses 64-256 tokens (4x): bucketing wastes <= 10%, padding wastes much more."""
    g = torch.Generator().manual_seed(0)
    prompt_len, response_len = 64, 256
    prompt_lens = torch.randint(16, prompt_len + 1, (64,), generator=g).tolist()
    resp_lens = torch.randint(response_len // 4, response_len + 1, (64,), generator=g).tolist()
    starts, ends = mb.real_token_spans(rollout_mask(prompt_lens, resp_lens, prompt_len, response_len))
    lengths = (ends - starts).tolist()
    bucketed = mb.padding_stats(lengths, mb.token_budget_micro_batches(lengths, max_tokens=4096))
    fixed = mb.padding_stats(lengths, mb.fixed_size_micro_batches(lengths, 8, sort=True))
    padded = mb.padding_stats(lengths, [list(range(64))], pad_to=prompt_len + response_len)
    assert bucketed["real_tokens"] == fixed["real_tokens"] == padded["real_tokens"] == sum(lengths)
    assert padded["computed_tokens"] == 64 * (prompt_len + response_len)
    assert bucketed["padding_waste"] <= 0.10 and fixed["padding_waste"] <= 0.10
    assert padded["padding_waste"] > 0.3


def test_bucket_strips_padding_and_points_at_the_predicting_positions():
    prompt_len, response_len = 4, 3
    mask = rollout_mask([2, 4], [3, 1], prompt_len, response_len)
    ids = torch.arange(1, 15).reshape(2, 7) * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    bucket = mb.build_bucket(ids, mask, pos, response_len, remove_padding=True, pad_token_id=0)
    assert bucket.input_ids.tolist() == [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]]
    assert bucket.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert bucket.attention_mask is None
    # row 0: response tokens 5,6,7 predicted from stripped positions 1,2,3; row 1: token 12 from position 3
    assert bucket.select_rows.tolist() == [0, 0, 0, 1] and bucket.select_cols.tolist() == [1, 2, 3, 3]
    assert bucket.target_ids.tolist() == [5, 6, 7, 12]
    assert bucket.input_ids[bucket.select_rows, bucket.select_cols + 1].tolist() == bucket.target_ids.tolist()
    assert bucket.out_rows.tolist() == [0, 0, 0, 1] and bucket.out_cols.tolist() == [0, 1, 2, 0]
    padded = mb.build_bucket(ids, mask, pos, response_len, remove_padding=False)
    assert padded.input_ids.shape == (2, 7) and padded.select_cols.tolist() == [3, 4, 5, 3]
