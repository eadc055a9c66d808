"""RLDataset: prompt files in veRL's schema, chat-templated and tokenized once, ready for rollout.

All rows are read, checked (see ``schema.py``) and tokenized when the dataset is built, so every bad row is reported
before training starts, and the overlong-prompt filter can be counted up front.

Prompt length handling (``max_prompt_length`` tokens, after the chat template). A text longer than
``(max_prompt_length + 2) * chars_per_token`` characters is overlong whatever its tokens are (``chars_per_token``
bounds the characters one token can stand for, from the vocabulary), so it is judged on its length alone and never
tokenized whole:
  * ``filter_overlong_prompts=True`` (default): longer rows are dropped, counted in ``stats["num_filtered_overlong"]``
    and reported in one log line;
  * otherwise ``truncation`` decides: ``"left"`` keeps the last tokens, ``"right"`` keeps the first ones,
    ``"error"`` (default) raises naming the file and row.
Duplicate rows (same data_source and prompt) are kept - they are legitimate in curated mixtures - and counted in
``stats["num_duplicate_prompts"]`` so an accidental concatenation shows up in the logs.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.data.parallel_prompts import PromptWork
from hybridflow.data.schema import DataConfigError, check_row
from hybridflow.data.sources import read_source

__all__ = ["RLDataset"]

logger = logging.getLogger(__name__)

_TRUNCATION_MODES = ("error", "left", "right")


class RLDataset:
    """Prompts from parquet/JSONL files in veRL's schema, reasoning-gym tasks or ``datasets`` folders (``sources.py``).

    ``ds[i]`` is a dict with ``input_ids`` LongTensor[L] (L <= max_prompt_length, no padding),
    ``attention_mask`` LongTensor[L] (all ones), and the row's fields: ``data_source``, ``raw_prompt`` (the chat list),
    ``ability``, ``reward_model`` (dict), ``ground_truth``, ``extra_info`` (dict) and ``index`` (= i).
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        apply_chat_template: bool = True,
        apply_chat_template_kwargs: dict[str, Any] | None = None,
        require_ground_truth: bool = True,
        name: str = "train",
        num_workers: int = 1,
    ) -> None:
        if truncation not in _TRUNCATION_MODES:
            raise DataConfigError(f"{name} dataset: truncation={truncation!r} is not one of {list(_TRUNCATION_MODES)}")
        if max_prompt_length < 1:
            raise DataConfigError(f"{name} dataset: max_prompt_length must be >= 1, got {max_prompt_length}")
        _check_tokenizer(tokenizer, apply_chat_template, name)
        self.name = name
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.filter_overlong_prompts = filter_overlong_prompts
        self.apply_chat_template = apply_chat_template
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.files = [os.fspath(f) for f in ([files] if isinstance(files, (str, os.PathLike)) else files)]
        if not self.files:
            raise DataConfigError(f"{name} dataset: no data files given; set data.{name}_files")

        rows: list[dict[str, Any]] = []
        origins: list[tuple[str, int]] = []
        for path in self.files:
            raw_rows = read_source(path, required_columns=["data_source", prompt_key])
            if not raw_rows:
                raise DataConfigError(
                    f"{name} dataset: data file {path!r} has no rows (its columns are there, its rows are not); "
                    f"write the prompts into it, or leave it out of data.{name}_files"
                )
            for i, raw in enumerate(raw_rows):
                rows.append(check_row(raw, path, i, prompt_key=prompt_key, require_ground_truth=require_ground_truth))
                origins.append((path, i))

        # templates and tokens in `num_workers` processes for large files (parallel_prompts.py); same result
        with PromptWork(tokenizer, len(rows), num_workers, apply_chat_template, self.apply_chat_template_kwargs) as work:
            token_ids, sure_overlong = self._ids(rows, origins, work)
            self.num_prompt_workers = work.workers
        self._rows: list[dict[str, Any]] = []
        self._input_ids: list[torch.Tensor] = []
        filtered = truncated = duplicates = prefiltered = 0
        seen: set[str] = set()
        for row, ids, over, (path, i) in zip(rows, token_ids, sure_overlong, origins):
            if over and filter_overlong_prompts:
                filtered += 1
                prefiltered += 1
                continue
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    filtered += 1
                    continue
                if truncation == "error":
                    raise DataConfigError(
                        f"data file {path!r}, row {i}, column {prompt_key!r}: the prompt is {len(ids)} tokens after the "
                        f"chat template, longer than max_prompt_length={max_prompt_length}; raise max_prompt_length, "
                        "set filter_overlong_prompts=True, or truncation='left'/'right'"
                    )
                ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
                truncated += 1
            key = json.dumps([row["data_source"], row["raw_prompt"]], sort_keys=True)
            if key in seen:
                duplicates += 1
            seen.add(key)
            self._rows.append(row)
            self._input_ids.append(torch.tensor(ids, dtype=torch.long))
        if filtered:
            logger.warning(
                "%s dataset: filtered %d of %d prompts longer than max_prompt_length=%d tokens",
                name, filtered, len(rows), max_prompt_length,
            )
        if duplicates:
            logger.info("%s dataset: %d duplicate prompts (kept)", name, duplicates)
        if not self._rows:
            raise DataConfigError(
                f"{name} dataset: all {len(rows)} prompts are longer than max_prompt_length={max_prompt_length} and "
                "were filtered; raise max_prompt_length or use truncation"
            )
        lengths = [len(t) for t in self._input_ids]
        self.stats: dict[str, Any] = {
            "num_rows_read": len(rows),
            "num_rows": len(self._rows),
            "num_filtered_overlong": filtered,
            "num_filtered_by_length_bound": prefiltered,  # of those, dropped on their character count alone
            "num_truncated": truncated,
            "num_duplicate_prompts": duplicates,
            "max_prompt_tokens": max(lengths),
            "mean_prompt_tokens": sum(lengths) / len(lengths),
            "num_prompt_workers": self.num_prompt_workers,  # processes that rendered and tokenized (1: the driver)
        }

    def _ids(self, rows: list[dict[str, Any]], origins: list[tuple[str, int]], work: PromptWork
             ) -> tuple[list[list[int]], list[bool]]:
        """(token ids, overlong by the character bound alone) of every row; see the module docstring."""
        max_prompt_length, filter_overlong_prompts, truncation = (
            self.max_prompt_length, self.filter_overlong_prompts, self.truncation)
        prompt_key = self.prompt_key
        texts = work.render([r["raw_prompt"] for r in rows], origins)
        # Cheap length bound before tokenizing: one token covers at most `chars_per_token` characters, so a text
        # longer than max_prompt_length * chars_per_token characters is overlong for sure. Such rows are dropped (or
        # cut to the kept side) without tokenizing them whole: a 10 MB row costs its own size, not the tokenizer's
        # per-token bookkeeping for millions of tokens.
        self.chars_per_token = _max_chars_per_token(self.tokenizer)
        limit_chars = (max_prompt_length + 2) * self.chars_per_token
        sure_overlong = [len(t) > limit_chars for t in texts]
        to_encode = []
        for text, over, (path, i) in zip(texts, sure_overlong, origins):
            if not over:
                to_encode.append(text)
            elif filter_overlong_prompts:
                to_encode.append("")  # counted as filtered below, never tokenized
            elif truncation == "error":
                raise DataConfigError(
                    f"data file {path!r}, row {i}, column {prompt_key!r}: the prompt is {len(text)} characters after "
                    f"the chat template, at least {len(text) // self.chars_per_token} tokens, longer than "
                    f"max_prompt_length={max_prompt_length}; raise max_prompt_length, set filter_overlong_prompts=True, "
                    "or truncation='left'/'right'"
                )
            else:  # tokenize only the side that is kept; the cut lies beyond the tokens kept
                to_encode.append(text[-limit_chars:] if truncation == "left" else text[:limit_chars])
        return work.encode(to_encode), sure_overlong

    def data_source_counts(self, key: str = "data_source") -> dict[str, int]:
        """Rows per value of column `key` (the reward function chooser, data.reward_fn_key)."""
        counts: dict[str, int] = {}
        for row in self._rows:
            value = str(row.get(key))
            counts[value] = counts.get(value, 0) + 1
        return counts

    def count_metrics(self) -> dict[str, float]:
        """What building the dataset dropped or noticed, as metrics (``data/<name>_...``): logged with every step."""
        st = self.stats
        return {
            f"data/{self.name}_rows": float(len(self)),
            f"data/{self.name}_filtered_overlong": float(st["num_filtered_overlong"]),
            f"data/{self.name}_truncated": float(st["num_truncated"]),
            f"data/{self.name}_duplicate_prompts": float(st["num_duplicate_prompts"]),
        }

    def describe(self) -> str:
        """One line for the console: rows kept, filtered, truncated and duplicated."""
        st = self.stats
        return (
            f"{self.name} data: {len(self)} of {st['num_rows_read']} prompts kept; "
            f"{st['num_filtered_overlong']} filtered as longer than max_prompt_length={self.max_prompt_length} tokens"
            f" ({st['num_filtered_by_length_bound']} on their character count alone), {st['num_truncated']} truncated,"
            f" {st['num_duplicate_prompts']} duplicates kept"
        )

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids = self._input_ids[index]
        row = self._rows[index]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            **row,
            "index": index if index >= 0 else len(self) + index,
        }

    def head(self, n: int) -> RLDataset:
        """The first `n` rows as a dataset of their own (e.g. data.val_max_samples)."""
        import copy

        out = copy.copy(self)
        out._rows, out._input_ids = self._rows[:n], self._input_ids[:n]
        out.stats = {**self.stats, "num_rows": len(out._rows)}
        return out

    def __repr__(self) -> str:
        return f"RLDataset(name={self.name!r}, rows={len(self)}, files={self.files})"


def _max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for: twice the longest vocabulary entry (special tokens
    included). Byte-level entries count bytes, which are never fewer than characters; the factor 2 covers
    normalizers that compose characters (NFC) before the vocabulary applies."""
    vocab = tokenizer.get_vocab()
    return 2 * max((len(t) for t in vocab), default=1)


def _check_tokenizer(tokenizer: Any, apply_chat_template: bool, name: str) -> None:
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise DataConfigError(
            f"{name} dataset: the tokenizer has no pad token; prompts are left-padded with it. Set one, e.g. "
            "tokenizer.pad_token = tokenizer.eos_token (or add a pad token to the tokenizer files)"
        )
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataConfigError(
            f"{name} dataset: the tokenizer has no chat template; set tokenizer.chat_template to a Jinja template, "
            "or pass apply_chat_template=False to feed the prompt messages' text as-is"
        )
