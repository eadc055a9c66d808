"""reasoning-gym tasks (PyPI ``reasoning-gym``) scored by the task's own ``score_answer``.

Rows made by ``hybridflow.data.sources`` carry in ``extra_info`` what the task needs: ``task`` (its registered
name), ``config`` (the keyword arguments the dataset was created with, e.g. size and seed) and ``entry`` (the
generated item: question, answer, metadata). The answer is what the response puts in its last
``<answer>...</answer>`` tags (reasoning-gym's own format and extraction); no tags scores 0.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["compute_score"]

_DATASETS: dict[str, Any] = {}  # one task object per (task, config) in each scoring process


def _dataset(task: str, config: dict[str, Any]) -> Any:
    import reasoning_gym

    key = json.dumps([task, config], sort_keys=True, default=str)
    if key not in _DATASETS:
        _DATASETS[key] = reasoning_gym.create_dataset(task, **config)
    return _DATASETS[key]


def compute_score(solution_str: str, extra_info: Any) -> float:
    """The task's ``score_answer(answer, entry)`` (in [0, 1]) for the answer tagged in `solution_str`."""
    from reasoning_gym.utils import extract_answer

    if not isinstance(extra_info, dict) or not {"task", "config", "entry"} <= set(extra_info):
        raise ValueError(
            "a reasoning_gym/* row needs extra_info with 'task', 'config' and 'entry' (rows from "
            "data.train_files=reasoning_gym:TASK?size=N&seed=S have them); got "
            f"{sorted(extra_info) if isinstance(extra_info, dict) else type(extra_info).__name__}"
        )
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    return float(_dataset(extra_info["task"], dict(extra_info["config"])).score_answer(answer, extra_info["entry"]))
