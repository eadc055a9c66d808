"""Prompt/response pairs for supervised fine-tuning, batched in the same layout as RL rollouts.

Rows come from parquet or JSONL: ``prompt`` (a chat list of {role, content} or a plain string) and ``response``
(a string; dotted keys such as ``extra_info.response`` reach into dict columns). The prompt gets the chat template,
the response gets the eos token, and batches look exactly like a rollout (left-padded prompts, right-padded
responses, response_mask), so SFT trains with the RL training engine unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.data.schema import DataConfigError
from hybridflow.data.sources import read_source
from hybridflow.protocol import DataProto


def _get(row: dict, dotted: str, where: str, dict_keys: tuple[str, ...] = ()) -> Any:
    """row[dotted] (dots reach into dict columns), then each of veRL's ``*_dict_keys`` in turn."""
    value: Any = row
    parts = [*dotted.split("."), *dict_keys]
    for i, part in enumerate(parts):
        if not isinstance(value, dict) or part not in value:
            path = ".".join(parts[: i + 1])
            raise DataConfigError(
                f"{where}: {path!r} is missing; set the SFT data.prompt_key/response_key (and prompt_dict_keys/"
                "response_dict_keys) to where the text is"
            )
        value = value[part]
    return value


class SFTDataset:
    def __init__(self, files: str | list[str], tokenizer, *, prompt_key: str = "prompt",
                 response_key: str = "response", max_length: int = 512,
                 prompt_dict_keys: tuple[str, ...] = (), response_dict_keys: tuple[str, ...] = (),
                 messages_key: str | None = None):
        """messages_key (veRL's data.multiturn): each row is a conversation in that column, trained on every
        assistant turn (see `_conversation`); otherwise one prompt and one response per row."""
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise DataConfigError("the tokenizer needs a pad token and an eos token for SFT batches")
        self.tokenizer = tokenizer
        # (prompt ids, response ids, loss mask over the response ids or None: all of them)
        self.examples: list[tuple[list[int], list[int], list[int] | None]] = []
        self.num_truncated = 0
        paths = [files] if isinstance(files, str) else list(files)
        rows = [(f"{path} row {i}", row) for path in paths for i, row in enumerate(read_source(path, []))]
        if messages_key is not None:
            for where, row in rows:
                self._add(*_conversation(tokenizer, _get(row, messages_key, where), where), max_length)
            return
        texts, responses = [], []
        for where, row in rows:
            prompt = _get(row, prompt_key, where, tuple(prompt_dict_keys))
            response = _get(row, response_key, where, tuple(response_dict_keys))
            if not isinstance(response, str) or not response:
                raise DataConfigError(f"{where}: {response_key!r} must be a non-empty string")
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            texts.append(tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False))
            responses.append(response)
        # one call each for all rows: the same ids as row by row, without the per-call overhead (half the time)
        prompt_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if rows else []
        response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"] if rows else []
        for p_ids, r_ids in zip(prompt_ids, response_ids):
            self._add(p_ids, [*r_ids, tokenizer.eos_token_id], None, max_length)

    def _add(self, prompt_ids: list[int], response_ids: list[int], loss_mask: list[int] | None, max_length: int) -> None:
        if len(prompt_ids) + len(response_ids) > max_length:
            self.num_truncated += 1
            keep = max(1, max_length - len(prompt_ids))
            response_ids = response_ids[:keep]
            loss_mask = None if loss_mask is None else loss_mask[:keep]
        self.examples.append((prompt_ids, response_ids, loss_mask))

    def __len__(self) -> int:
        return len(self.examples)

    def collate(self, indices: list[int] | np.ndarray) -> DataProto:
        """Rows -> prompts [B, P] left-padded, responses [B, R] right-padded, plus the rollout-layout tensors."""
        pad = self.tokenizer.pad_token_id
        rows = [self.examples[int(i)] for i in indices]
        p_len = max(len(p) for p, _, _ in rows)
        r_len = max(len(r) for _, r, _ in rows)
        prompts = torch.full((len(rows), p_len), pad, dtype=torch.long)
        responses = torch.full((len(rows), r_len), pad, dtype=torch.long)
        p_mask = torch.zeros(len(rows), p_len, dtype=torch.long)
        r_mask = torch.zeros(len(rows), r_len, dtype=torch.long)
        loss_mask = torch.zeros(len(rows), r_len, dtype=torch.long)
        for i, (p, r, m) in enumerate(rows):
            prompts[i, p_len - len(p):] = torch.tensor(p)
            p_mask[i, p_len - len(p):] = 1
            responses[i, : len(r)] = torch.tensor(r)
            r_mask[i, : len(r)] = 1
            loss_mask[i, : len(r)] = 1 if m is None else torch.tensor(m)  # multi-turn: assistant tokens only
        attention_mask = torch.cat([p_mask, r_mask], dim=1)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return DataProto.from_dict(
            {
                "prompts": prompts,
                "responses": responses,
                "input_ids": torch.cat([prompts, responses], dim=1),
                "attention_mask": attention_mask,
                "position_ids": position_ids,
                "response_mask": loss_mask.float(),
            }
        )


def _conversation(tokenizer, messages: Any, where: str) -> tuple[list[int], list[int], list[int]]:
    """A chat [{role, content}, ...] -> (prompt ids: everything before the first assistant turn, the rest, its loss
    mask: 1 on each assistant turn's tokens as the chat template renders them, 0 on the other turns').

    Each assistant turn's tokens are the template of the messages up to it minus the template of the ones before it
    (with the generation prompt), so the template must render a conversation as the concatenation of its prefixes.
    """
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise DataConfigError(f"{where}: the messages column must be a list of {{role, content}} dicts")
    messages = [dict(m) for m in messages]
    roles = [m.get("role") for m in messages]
    if "assistant" not in roles:
        raise DataConfigError(f"{where}: the conversation has no assistant turn to train on")

    def ids(upto: int, generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages[:upto], add_generation_prompt=generation_prompt, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    full = ids(len(messages), False)
    mask = [0] * len(full)
    first = None
    for i, role in enumerate(roles):
        if role != "assistant":
            continue
        start, end = len(ids(i, True)), len(ids(i + 1, False))
        if ids(i + 1, False) != full[:end] or end <= start:
            raise DataConfigError(
                f"{where}: the chat template does not render this conversation as the concatenation of its turns "
                f"(turn {i}), so the assistant tokens cannot be found; use a template without that, or one-turn data"
            )
        first = start if first is None else first
        mask[start:end] = [1] * (end - start)
    return full[:first], full[first:], mask[first:]
