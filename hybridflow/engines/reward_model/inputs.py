"""What a reward model reads for each row: the prompt's tokens, then the response's, cut to the configured lengths.

The rollout batch holds left-padded prompts ``input_ids[:, :P]`` and right-padded responses ``responses [B, R]``
(``attention_mask [B, P+R]`` marks the real tokens). A reward model scores the sequence ``prompt + response`` at its
last token, so padding must not sit between the two or after the response. ``rm_token_rows`` takes the real tokens
of each row out of the padding:

* ``prompt_length`` (veRL's ``reward_model.rollout.prompt_length``): only the *last* that many prompt tokens are kept
  (the end of a prompt is what the response answers; its start is dropped).
* ``response_length`` (``reward_model.rollout.response_length``): only the *first* that many response tokens are
  kept, so an over-long response is scored on its beginning.

``None`` keeps every token. Both engines (hf, vllm) score exactly these rows, so they see the same input.
"""

from __future__ import annotations

import torch


def rm_token_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    prompt_length: int | None = None,
    response_length: int | None = None,
) -> list[list[int]]:
    """``input_ids/attention_mask [B, P+R]`` with ``R = response_width`` -> B token lists (prompt part, response part).

    A row with no real token at all (an empty prompt and an empty response) raises: there is nothing to score.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    if not 0 <= response_width <= input_ids.shape[1]:
        raise ValueError(f"response width {response_width} does not fit in {input_ids.shape[1]} columns")
    for name, value in (("prompt_length", prompt_length), ("response_length", response_length)):
        if value is not None and value < 1:
            raise ValueError(f"reward_model.rollout.{name}={value} must be >= 1 (or null: no cut)")
    split = input_ids.shape[1] - response_width
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    rows: list[list[int]] = []
    for i in range(ids.shape[0]):
        prompt = ids[i, :split][mask[i, :split]].tolist()
        response = ids[i, split:][mask[i, split:]].tolist()
        if prompt_length is not None:
            prompt = prompt[-prompt_length:]
        if response_length is not None:
            response = response[:response_length]
        if not prompt and not response:
            raise ValueError(f"row {i} of the batch has no real token (its attention_mask is all zero); cannot score it")
        rows.append(prompt + response)
    return rows


def pad_rows(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> ``input_ids, attention_mask, last [B]`` (the index of each row's last real token).

    Right padding keeps every real token before any pad, so a causal model's hidden state at ``last`` saw the whole
    row and nothing else, and positions count from 0 in every row.
    """
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask, torch.tensor([len(r) - 1 for r in rows], dtype=torch.long)
