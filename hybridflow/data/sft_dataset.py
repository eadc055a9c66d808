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
                 prompt_dict_keys: tuple[str, ...] = (), response_dict_keys: tuple[str, ...] = ()):
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise DataConfigError("the tokenizer needs a pad token and an eos token for SFT batches")
        self.tokenizer = tokenizer
        self.examples: list[tuple[list[int], list[int]]] = []
        self.num_truncated = 0
        paths = [files] if isinstance(files, str) else list(files)
        rows = [(f"{path} row {i}", row) for path in paths for i, row in enumerate(read_source(path, []))]
        for where, row in rows:
            prompt = _get(row, prompt_key, where, tuple(prompt_dict_keys))
            response = _get(row, response_key, where, tuple(response_dict_keys))
            if not isinstance(response, str) or not response:
                raise DataConfigError(f"{where}: {response_key!r} must be a non-empty string")
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
            prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            if len(prompt_ids) + len(response_ids) > max_length:
                self.num_truncated += 1
                response_ids = response_ids[: max(1, max_length - len(prompt_ids))]
            self.examples.append((prompt_ids, response_ids))

    def __len__(self) -> int:
        return len(self.examples)

    def collate(self, indices: list[int] | np.ndarray) -> DataProto:
        """Rows -> prompts [B, P] left-padded, responses [B, R] right-padded, plus the rollout-layout tensors."""
        pad = self.tokenizer.pad_token_id
        rows = [self.examples[int(i)] for i in indices]
        p_len = max(len(p) for p, _ in rows)
        r_len = max(len(r) for _, r in rows)
        prompts = torch.full((len(rows), p_len), pad, dtype=torch.long)
        responses = torch.full((len(rows), r_len), pad, dtype=torch.long)
        p_mask = torch.zeros(len(rows), p_len, dtype=torch.long)
        r_mask = torch.zeros(len(rows), r_len, dtype=torch.long)
        for i, (p, r) in enumerate(rows):
            prompts[i, p_len - len(p):] = torch.tensor(p)
            p_mask[i, p_len - len(p):] = 1
            responses[i, : len(r)] = torch.tensor(r)
            r_mask[i, : len(r)] = 1
        attention_mask = torch.cat([p_mask, r_mask], dim=1)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return DataProto.from_dict(
            {
                "prompts": prompts,
                "responses": responses,
                "input_ids": torch.cat([prompts, responses], dim=1),
                "attention_mask": attention_mask,
                "position_ids": position_ids,
                "response_mask": r_mask.float(),
            }
        )
