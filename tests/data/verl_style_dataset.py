"""A dataset class written the way veRL users write theirs (data.custom_cls): veRL's constructor signature, items in
veRL's RLHFDataset layout (left-padded input_ids to max_prompt_length + attention_mask, data_source, reward_model)."""

from __future__ import annotations

import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset


class ReversedPrompts(Dataset):
    """Every row of the parquet files, in reverse order (a test tells its rows from hybridflow's own by that)."""

    def __init__(self, data_files, tokenizer, processor, config):
        assert processor is None
        self.tokenizer, self.max_len = tokenizer, int(config.get("max_prompt_length", 1024))
        self.rows = [r for f in data_files for r in pq.read_table(f).to_pylist()][::-1]
        self.prompt_key = config.get("prompt_key", "prompt")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = dict(self.rows[i])
        chat = row.pop(self.prompt_key)
        ids = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        pad = self.max_len - len(ids)
        input_ids = torch.tensor([self.tokenizer.pad_token_id] * pad + ids)
        attention_mask = torch.tensor([0] * pad + [1] * len(ids))
        return {**row, "input_ids": input_ids, "attention_mask": attention_mask, "raw_prompt": chat}


class NotADataset:
    def __init__(self, **kwargs):
        pass
