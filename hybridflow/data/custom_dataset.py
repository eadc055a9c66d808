"""veRL's ``data.custom_cls.path`` / ``data.custom_cls.name``: prompts from a user's dataset class.

The class is loaded from the file and built with veRL's signature::

    MyDataset(data_files=[...], tokenizer=tokenizer, processor=None, config=data_section)   # + max_samples=-1
                                                                                            #   if it takes one
It must be a ``torch.utils.data.Dataset`` (as veRL requires); ``config`` is the data section as an OmegaConf
DictConfig (``config.get("max_prompt_length")``, ``config.prompt_key`` ...; processor is None: text models only).
Every item is read once at start, as hybridflow's own datasets are, so a bad item is reported before training, and
is turned into hybridflow's prompt row (``RLDataset``'s layout). An item is a dict in veRL's RLHFDataset layout:
  * the prompt as tokens: ``raw_prompt_ids`` (unpadded), or ``input_ids`` + ``attention_mask`` (padding dropped);
    or, without tokens, ``raw_prompt`` (chat messages), templated and tokenized here as the parquet rows are;
  * ``data_source`` (picks the scorer), ``reward_model`` (with ``ground_truth``), optional ``ability``,
    ``extra_info``; ``raw_prompt`` rides along with data.return_raw_chat (then it is required).
Prompts longer than data.max_prompt_length follow data.filter_overlong_prompts / data.truncation, counted as usual.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from typing import Any

import torch

from hybridflow.data.dataset import RLDataset, _check_tokenizer
from hybridflow.data.schema import DataConfigError, check_row

__all__ = ["CustomClassDataset", "load_dataset_class"]

logger = logging.getLogger(__name__)


def load_dataset_class(path: str, name: str | None) -> type:
    """The class `name` of the Python file `path`; DataConfigError naming both when it is missing or no Dataset."""
    from torch.utils.data import Dataset

    from hybridflow.plugins import PluginError, import_file

    if not name:
        raise DataConfigError(f"data.custom_cls.path={path!r} needs data.custom_cls.name=<the class in that file>")
    try:
        module = import_file(os.path.expanduser(path), what="data.custom_cls.path")
    except PluginError as err:
        raise DataConfigError(str(err)) from None
    cls = getattr(module, name, None)
    if cls is None:
        raise DataConfigError(f"data.custom_cls.name={name!r}: {path} defines no such name")
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        raise DataConfigError(f"data.custom_cls.name={name!r} in {path} must be a class inheriting from "
                              f"torch.utils.data.Dataset (veRL's rule), got {cls!r}")
    return cls


class CustomClassDataset(RLDataset):
    """An RLDataset whose rows come from the items of a user's dataset class (see the module docstring)."""

    def __init__(self, cls: type, files: Any, tokenizer: Any, data_config: Any, *, name: str = "train",
                 require_raw_chat: bool = False) -> None:
        from omegaconf import OmegaConf

        _check_tokenizer(tokenizer, True, name)
        self.name, self.tokenizer = name, tokenizer
        self.prompt_key = "raw_prompt"
        self.max_prompt_length = int(data_config.max_prompt_length)
        self.truncation, self.filter_overlong_prompts = data_config.truncation, data_config.filter_overlong_prompts
        self.apply_chat_template = True
        self.apply_chat_template_kwargs = dict(data_config.apply_chat_template_kwargs or {})
        self.files = [os.fspath(f) for f in ([files] if isinstance(files, (str, os.PathLike)) else list(files or []))]
        kwargs: dict[str, Any] = dict(data_files=self.files, tokenizer=tokenizer, processor=None,
                                      config=OmegaConf.structured(data_config))
        if "max_samples" in inspect.signature(cls.__init__).parameters:
            kwargs["max_samples"] = -1
        where = f"{name} dataset {cls.__name__} (data.custom_cls)"
        try:
            user = cls(**kwargs)
            count = len(user)
        except Exception as err:
            raise DataConfigError(f"{where}: building it with veRL's arguments (data_files, tokenizer, processor, "
                                  f"config) failed: {type(err).__name__}: {err}") from err
        self._rows, self._input_ids = [], []
        filtered = truncated = duplicates = 0
        seen: set[str] = set()
        for i in range(count):
            row, ids = self._convert(user[i], i, where, require_raw_chat)
            if len(ids) > self.max_prompt_length:
                if self.filter_overlong_prompts:
                    filtered += 1
                    continue
                if self.truncation == "error":
                    raise DataConfigError(
                        f"{where}, item {i}: the prompt is {len(ids)} tokens, longer than max_prompt_length="
                        f"{self.max_prompt_length}; raise it, set data.filter_overlong_prompts=true, or data.truncation="
                        "left/right")
                ids = ids[-self.max_prompt_length:] if self.truncation == "left" else ids[:self.max_prompt_length]
                truncated += 1
            key = json.dumps([row["data_source"], ids], sort_keys=True)
            duplicates += key in seen
            seen.add(key)
            self._rows.append(row)
            self._input_ids.append(torch.tensor(ids, dtype=torch.long))
        if not self._rows:
            raise DataConfigError(f"{where}: none of its {count} items is left (empty, or every prompt is longer than "
                                  f"max_prompt_length={self.max_prompt_length} and was filtered)")
        if filtered:
            logger.warning("%s: filtered %d of %d prompts longer than max_prompt_length=%d tokens", where, filtered,
                           count, self.max_prompt_length)
        lengths = [len(t) for t in self._input_ids]
        self.stats = {"num_rows_read": count, "num_rows": len(self._rows), "num_filtered_overlong": filtered,
                      "num_filtered_by_length_bound": 0, "num_truncated": truncated,
                      "num_duplicate_prompts": duplicates, "max_prompt_tokens": max(lengths),
                      "mean_prompt_tokens": sum(lengths) / len(lengths)}

    def _convert(self, item: Any, i: int, where: str, require_raw_chat: bool) -> tuple[dict[str, Any], list[int]]:
        """One user item -> (hybridflow's row fields, the prompt's token ids without padding)."""
        if not isinstance(item, dict):
            raise DataConfigError(f"{where}, item {i}: expected a dict (veRL's item layout), got {type(item).__name__}")
        chat = item.get("raw_prompt")
        if chat is None and require_raw_chat:
            raise DataConfigError(f"{where}, item {i}: no 'raw_prompt' (chat messages), which data.return_raw_chat=true "
                                  "and multi-turn rollouts need; return it from __getitem__")
        raw = {key: item.get(key)
               for key in ("data_source", "ability", "reward_model", "extra_info", "ground_truth", "agent_name")}
        # check_row validates a prompt too; an item of tokens only has none, so it gets a stand-in, dropped after
        raw["raw_prompt"] = chat if chat is not None else [{"role": "user", "content": "(tokens only)"}]
        row = check_row(raw, where, i, prompt_key="raw_prompt", require_ground_truth=True)
        if chat is None:
            row["raw_prompt"] = None
        return row, self._token_ids(item, chat, i, where)

    def _token_ids(self, item: dict, chat: Any, i: int, where: str) -> list[int]:
        if item.get("raw_prompt_ids") is not None:
            return [int(t) for t in item["raw_prompt_ids"]]
        if item.get("input_ids") is not None:
            ids = torch.as_tensor(item["input_ids"]).reshape(-1)
            mask = item.get("attention_mask")
            if mask is not None:
                ids = ids[torch.as_tensor(mask).reshape(-1).bool()]
            return ids.tolist()
        if chat is None:
            raise DataConfigError(f"{where}, item {i}: no prompt: give raw_prompt_ids, input_ids (+ attention_mask) or "
                                  "raw_prompt (chat messages)")
        return self._encode(self._render([chat], [(where, i)]))[0]
