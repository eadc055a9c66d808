"""Reading prompt files in veRL's schema (parquet or JSONL) and checking each row.

One row of an RL prompt file:
  ``data_source``   str, chooses the reward function (e.g. "openai/gsm8k", "hybridflow/arithmetic")
  ``prompt``        the chat as a list of ``{"role": str, "content": str}``
  ``ability``       str, free-form tag (e.g. "math"); optional
  ``reward_model``  ``{"style": "rule", "ground_truth": ...}``; ground_truth is a str, a number, a list or a dict
  ``extra_info``    dict, free-form (often ``index``, ``split``, ``question``, ``answer``); optional
  ``agent_name``    str, veRL's agent loop for the row: ``single_turn_agent`` or ``tool_agent``; optional

Files written by veRL's preprocessing scripts read as they are. Every problem is raised as a DataConfigError that
names the file, the row (0-based) and the column, and says how to fix it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["DataConfigError", "check_row", "read_rows"]


class DataConfigError(ValueError):
    """A data file or data setting is unusable; the message names the file/row/column and how to fix it."""


def read_rows(path: str | os.PathLike, required_columns: Sequence[str]) -> list[dict[str, Any]]:
    """All rows of one parquet (``.parquet``) or JSON-lines (``.jsonl`` / ``.json``) file as Python dicts."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataConfigError(f"data file {path!r} does not exist; check data.train_files / data.val_files")
    if os.path.isdir(path):
        raise DataConfigError(f"data file {path!r} is a directory; name the .parquet or .jsonl file(s) inside it")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        rows, columns = _read_parquet(path)
    elif ext in (".jsonl", ".json"):
        rows, columns = _read_jsonl(path)
    else:
        raise DataConfigError(f"data file {path!r}: unknown extension {ext!r}; use .parquet or .jsonl (one JSON object a line)")
    missing = [c for c in required_columns if c not in columns]
    if missing:
        raise DataConfigError(
            f"data file {path!r} has no column(s) {missing} (it has {sorted(columns)}); "
            "write rows in veRL's schema (data_source, prompt, ability, reward_model, extra_info) "
            "or name your prompt column with data.prompt_key=<column> (RLDataset(prompt_key=...))"
        )
    return rows


def _read_parquet(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataConfigError(f"data file {path!r} is not a readable parquet file: {e}") from e
    columns = list(table.column_names)
    try:
        rows = table.to_pylist()
    except (pa.ArrowException, UnicodeDecodeError) as e:
        # Arrow string columns holding invalid UTF-8 fail here; find the row so the user can fix it.
        raise DataConfigError(_locate_bad_utf8(table, path, e)) from e
    return rows, columns


def _locate_bad_utf8(table: Any, path: str, error: Exception) -> str:
    for name in table.column_names:
        col = table.column(name)
        for i in range(len(col)):
            try:
                col[i].as_py()
            except Exception:
                return (
                    f"data file {path!r}, row {i}, column {name!r}: text is not valid UTF-8 ({error}); "
                    "re-encode the file as UTF-8"
                )
    return f"data file {path!r} could not be converted to Python values: {error}; re-encode the file as UTF-8"


def _read_jsonl(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    columns: dict[str, None] = {}
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataConfigError(
                    f"data file {path!r}, line {line_no} (row {len(rows)}): bytes at offset {e.start} are not valid "
                    "UTF-8; re-encode the file as UTF-8"
                ) from e
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataConfigError(
                    f"data file {path!r}, line {line_no} (row {len(rows)}): not valid JSON ({e.msg} at column {e.colno}); "
                    "JSONL needs one JSON object per line"
                ) from e
            if not isinstance(obj, dict):
                raise DataConfigError(
                    f"data file {path!r}, line {line_no} (row {len(rows)}): expected a JSON object, got "
                    f"{type(obj).__name__}"
                )
            rows.append(obj)
            columns.update(dict.fromkeys(obj))
    if not rows:
        raise DataConfigError(f"data file {path!r} holds no rows")
    return rows, list(columns)


def _where(path: str, row: int, column: str) -> str:
    return f"data file {path!r}, row {row}, column {column!r}"


def check_row(
    row: dict[str, Any], path: str, index: int, *, prompt_key: str, require_ground_truth: bool
) -> dict[str, Any]:
    """Validate one raw row and return its normalised fields.

    Returns ``{data_source, raw_prompt, ability, reward_model, ground_truth, extra_info, agent_name}`` with
    ``raw_prompt`` a list of ``{"role", "content"}`` dicts, ``reward_model`` / ``extra_info`` dicts and ``agent_name``
    veRL's optional per-row agent loop (None when the row has none).
    """
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise DataConfigError(
            f"{_where(path, index, 'data_source')}: expected a non-empty string, got {_describe(data_source)}; "
            "data_source picks the reward function (e.g. 'openai/gsm8k')"
        )
    raw_prompt = _check_prompt(row.get(prompt_key), path, index, prompt_key)

    ability = row.get("ability")
    if ability is None:
        ability = ""
    if not isinstance(ability, str):
        raise DataConfigError(f"{_where(path, index, 'ability')}: expected a string, got {_describe(ability)}")

    reward_model = row.get("reward_model")
    if reward_model is None:
        reward_model = {}
    if not isinstance(reward_model, dict):
        raise DataConfigError(
            f"{_where(path, index, 'reward_model')}: expected a dict like {{'style': 'rule', 'ground_truth': ...}}, "
            f"got {_describe(reward_model)}"
        )
    ground_truth = reward_model.get("ground_truth")
    if "ground_truth" in row and row["ground_truth"] is not None:
        # Some converters write the answer twice (a top-level column and reward_model); two answers must agree.
        if ground_truth is not None and row["ground_truth"] != ground_truth:
            raise DataConfigError(
                f"{_where(path, index, 'ground_truth')}: two different ground truths, {_describe(row['ground_truth'])} "
                f"in column 'ground_truth' and {_describe(ground_truth)} in reward_model.ground_truth; keep one"
            )
        ground_truth = row["ground_truth"]
    if isinstance(ground_truth, bytes):
        ground_truth = _decode(ground_truth, path, index, "reward_model.ground_truth")
    if require_ground_truth and (ground_truth is None or (isinstance(ground_truth, str) and not ground_truth.strip())):
        raise DataConfigError(
            f"{_where(path, index, 'reward_model')}: no ground truth (reward_model.ground_truth is "
            f"{_describe(ground_truth)}); rule rewards need it - fill it in or drop the row"
        )

    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise DataConfigError(f"{_where(path, index, 'extra_info')}: expected a dict, got {_describe(extra_info)}")
    agent_name = row.get("agent_name")
    if agent_name is not None and not isinstance(agent_name, str):
        raise DataConfigError(f"{_where(path, index, 'agent_name')}: expected a string (veRL's agent loop name, e.g. "
                              f"'tool_agent'), got {_describe(agent_name)}")
    return {
        "data_source": data_source,
        "raw_prompt": raw_prompt,
        "ability": ability,
        "reward_model": dict(reward_model, ground_truth=ground_truth),
        "ground_truth": ground_truth,
        "extra_info": extra_info,
        "agent_name": agent_name or None,
    }


def _check_prompt(value: Any, path: str, index: int, key: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        raise DataConfigError(
            f"{_where(path, index, key)}: expected a chat list [{{'role': 'user', 'content': ...}}], got a plain "
            "string; wrap it as a one-message chat"
        )
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):  # numpy arrays from pandas-written files
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise DataConfigError(
            f"{_where(path, index, key)}: expected a chat list of {{'role', 'content'}} dicts, got {_describe(value)}"
        )
    if not value:
        raise DataConfigError(f"{_where(path, index, key)}: the prompt is empty (no messages); drop the row or fill it in")
    messages = []
    for j, msg in enumerate(value):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise DataConfigError(
                f"{_where(path, index, key)}, message {j}: expected a dict with 'role' and 'content', got {_describe(msg)}"
            )
        role, content = msg["role"], msg["content"]
        if isinstance(content, bytes):
            content = _decode(content, path, index, f"{key}[{j}].content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise DataConfigError(
                f"{_where(path, index, key)}, message {j}: role and content must be strings, got "
                f"role={_describe(role)}, content={_describe(content)}"
            )
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        raise DataConfigError(
            f"{_where(path, index, key)}: the prompt is empty (every message's content is blank); "
            "drop the row or fill it in"
        )
    return messages


def _decode(value: bytes, path: str, index: int, column: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataConfigError(
            f"{_where(path, index, column)}: bytes at offset {e.start} are not valid UTF-8; re-encode the text as UTF-8"
        ) from e


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"
