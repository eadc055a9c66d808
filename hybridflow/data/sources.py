"""Where prompt rows come from: files (parquet/JSONL, ``schema.py``), reasoning-gym tasks by name, and Hugging Face
``datasets`` folders written with ``save_to_disk``. Every source yields rows in veRL's schema.

    data.train_files='reasoning_gym:leg_counting?size=512&seed=1'
    data.val_files='reasoning_gym:leg_counting?size=64&seed=2'      # another seed: other items
    data.train_files=~/data/gsm8k_hf/train                          # a datasets.Dataset.save_to_disk folder

reasoning-gym (``pip install reasoning-gym``, or ``.[data]``): ``reasoning_gym:TASK?key=value&...`` creates the task's
dataset with those keyword arguments (``size`` and ``seed`` are required so that train and validation sets are
reproducible and told apart; other keys are the task's own options, e.g. ``min_animals=2``), except
``system_prompt``: the name of one of reasoning-gym's system prompts (default ``default``, which asks for the answer
in ``<answer>`` tags) or ``none``. Each item becomes a row with ``data_source`` ``reasoning_gym/TASK`` - scored by
the task's own ``score_answer`` (``rewards/scorers/reasoning_gym_tasks.py``) - and ``extra_info`` carrying the task,
its config and the generated entry (and ``response``, the gold answer in tags, so ``hybridflow sft
data.response_key=extra_info.response`` can warm-start a model on the same task). Quote the spec in a shell: ``&`` and ``?`` are special there.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl

import yaml

from hybridflow.data.schema import DataConfigError, read_rows

__all__ = ["REASONING_GYM_PREFIX", "is_hf_datasets_folder", "read_source", "reasoning_gym_rows"]

REASONING_GYM_PREFIX = "reasoning_gym:"
# reasoning-gym items may have no single answer (the scorer judges the entry); the schema needs a non-empty one.
_NO_SINGLE_ANSWER = "(judged by the reasoning-gym task)"


def read_source(spec: str | os.PathLike, required_columns: Sequence[str]) -> list[dict[str, Any]]:
    """All rows of one source (see the module docstring) as dicts in veRL's schema."""
    spec = os.fspath(spec)
    if spec.startswith(REASONING_GYM_PREFIX):
        return reasoning_gym_rows(spec)
    path = os.path.expanduser(spec)
    if os.path.isdir(path) and is_hf_datasets_folder(path):
        return _hf_datasets_rows(path, required_columns)
    return read_rows(path, required_columns=required_columns)


# ----------------------------------------------------------------------------------------------------- reasoning-gym
def _parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    body = spec[len(REASONING_GYM_PREFIX):]
    task, _, query = body.partition("?")
    if not task:
        raise DataConfigError(f"data source {spec!r}: name the task, e.g. 'reasoning_gym:leg_counting?size=64&seed=1'")
    params: dict[str, Any] = {}
    for key, raw in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key in params:
            raise DataConfigError(f"data source {spec!r}: {key!r} is given twice")
        params[key] = yaml.safe_load(raw) if raw else raw  # 64 -> int, 0.5 -> float, true -> bool, text stays
    return task, params


def reasoning_gym_rows(spec: str) -> list[dict[str, Any]]:
    """``reasoning_gym:TASK?size=N&seed=S[&option=value...][&system_prompt=NAME|none]`` -> rows in veRL's schema."""
    try:
        import reasoning_gym
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError as e:
        raise DataConfigError(
            f"data source {spec!r} needs the reasoning-gym package ({e}); pip install reasoning-gym "
            "(or `pip install -e '.[data]'`)"
        ) from e
    try:
        task, params = _parse_spec(spec)
    except ValueError as e:  # parse_qsl's own complaint about a malformed query
        raise DataConfigError(f"data source {spec!r}: {e}; write it as reasoning_gym:TASK?size=N&seed=S") from e
    known = sorted(reasoning_gym.factory.DATASETS)
    if task not in known:
        close = difflib.get_close_matches(task, known, n=3, cutoff=0.5)
        raise DataConfigError(
            f"data source {spec!r}: reasoning-gym has no task {task!r}"
            + (f"; did you mean {' or '.join(close)}?" if close else f"; {len(known)} tasks, e.g. {known[:8]}")
        )
    missing = [k for k in ("size", "seed") if k not in params]
    if missing:
        raise DataConfigError(
            f"data source {spec!r}: give {' and '.join(missing)} (e.g. ?size=256&seed=1), so the set is reproducible "
            "and validation can use another seed than training"
        )
    prompt_name = params.pop("system_prompt", "default")
    if prompt_name != "none" and prompt_name not in SYSTEM_PROMPTS:
        raise DataConfigError(
            f"data source {spec!r}: system_prompt={prompt_name!r}; choose none or one of {sorted(SYSTEM_PROMPTS)}"
        )
    try:
        dataset = reasoning_gym.create_dataset(task, **params)
    except (TypeError, ValueError, AssertionError) as e:  # unknown option, or the task's config.validate() refused
        options = sorted(getattr(reasoning_gym.factory.DATASETS[task][1], "__dataclass_fields__", {}))
        raise DataConfigError(
            f"data source {spec!r}: reasoning-gym refused the options {params} ({type(e).__name__}: {e}); "
            f"{task}'s options are {options}"
        ) from e
    system = [] if prompt_name == "none" else [{"role": "system", "content": SYSTEM_PROMPTS[prompt_name]}]
    rows = []
    for i, entry in enumerate(dataset):
        answer = entry.get("answer")
        rows.append({
            "data_source": f"reasoning_gym/{task}",
            "prompt": [*system, {"role": "user", "content": entry["question"]}],
            "ability": "reasoning",
            "reward_model": {"style": "rule", "ground_truth": _NO_SINGLE_ANSWER if answer in (None, "") else str(answer)},
            # response: the gold answer in the format the system prompt asks for, for `hybridflow sft` warm starts
            # (data.response_key=extra_info.response)
            "extra_info": {"index": i, "task": task, "config": dict(params), "entry": dict(entry),
                           "response": f"<answer>{answer}</answer>"},
        })
    return rows


# ----------------------------------------------------------------------------------------------------- HF datasets
def is_hf_datasets_folder(path: str) -> bool:
    """A folder written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``)."""
    return any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))


def _hf_datasets_rows(path: str, required_columns: Sequence[str]) -> list[dict[str, Any]]:
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise DataConfigError(
            f"data folder {path!r} is a DatasetDict with splits {splits}; name one split's folder, e.g. "
            f"{os.path.join(path, splits[0] if splits else 'train')}"
        )
    try:
        from datasets import load_from_disk
    except ImportError as e:
        raise DataConfigError(
            f"data folder {path!r} was written by Hugging Face datasets; reading it needs that package ({e}): "
            "pip install datasets (or `pip install -e '.[data]'`)"
        ) from e
    try:
        ds = load_from_disk(path)
    except Exception as e:  # datasets raises its own FileNotFoundError/ValueError subclasses for broken folders
        raise DataConfigError(f"data folder {path!r} could not be read by datasets.load_from_disk: {e}") from e
    missing = [c for c in required_columns if c not in ds.column_names]
    if missing:
        raise DataConfigError(
            f"data folder {path!r} has no column(s) {missing} (it has {sorted(ds.column_names)}); write rows in "
            "veRL's schema (data_source, prompt, ability, reward_model, extra_info) or pass prompt_key=<your column>"
        )
    rows = ds.to_list()
    if not rows:
        raise DataConfigError(f"data folder {path!r} holds no rows")
    return rows
