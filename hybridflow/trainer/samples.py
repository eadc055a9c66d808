"""Rollout samples on disk: what the policy actually wrote, next to its score, every few steps.

Rows go to ``<run_dir>/samples.jsonl``, one JSON object per sample:
``{"step", "split", "index", "prompt", "response", "score", "reward"?, "ground_truth"?}``; multi-turn rows also hold
``conversation`` (the episode turn by turn: ``[{"role", "content"}, ...]``, tool results included), ``num_turns``,
``termination`` and ``tool_calls`` (name, arguments, error kind of each call). When a batch has more than
`max_rows` samples the best half and the worst half by score are kept (ties by batch order) — the extremes are what
one reads to see reward hacking or collapse, and what ``hybridflow report`` shows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["RolloutSampleWriter", "select_extremes"]


def select_extremes(scores: Sequence[float], max_rows: int) -> list[int]:
    """Indices of the ceil(max_rows/2) highest and floor(max_rows/2) lowest scores, in batch order.

    All indices when there are at most `max_rows`; among equal scores the earlier row wins.
    """
    n = len(scores)
    if n <= max_rows:
        return list(range(n))
    order = sorted(range(n), key=lambda i: (-float(scores[i]), i))
    best = order[: (max_rows + 1) // 2]
    worst = sorted(range(n), key=lambda i: (float(scores[i]), i))[: max_rows // 2]
    return sorted(set(best) | set(worst))


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):  # numpy arrays / scalars, tensors
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    return str(x)


class RolloutSampleWriter:
    """Append rollout samples to ``<run_dir>/samples.jsonl`` every `every_n_steps` steps (at most `max_rows` each)."""

    def __init__(self, run_dir: str, every_n_steps: int = 1, max_rows: int = 16) -> None:
        if every_n_steps < 1 or max_rows < 1:
            raise ValueError(
                f"every_n_steps and max_rows must be >= 1, got every_n_steps={every_n_steps}, max_rows={max_rows}; "
                "to write no samples, do not create a RolloutSampleWriter"
            )
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "samples.jsonl")
        self.every_n_steps = every_n_steps
        self.max_rows = max_rows

    def maybe_write(
        self,
        step: int,
        prompts: Sequence[str],
        responses: Sequence[str],
        scores: Sequence[float],
        rewards: Sequence[float] | None = None,
        ground_truths: Sequence[Any] | None = None,
        *,
        split: str = "train",
        episodes: Sequence[dict[str, Any]] | None = None,
    ) -> bool:
        """Write this step's samples if `step` is a multiple of `every_n_steps` (at most `max_rows`: the best and the
        worst by score); returns whether it wrote."""
        if step % self.every_n_steps:
            return False
        self.write(step, prompts, responses, scores, rewards, ground_truths, split=split,
                   rows=select_extremes(scores, self.max_rows), episodes=episodes)
        return True

    def write(
        self,
        step: int,
        prompts: Sequence[str],
        responses: Sequence[str],
        scores: Sequence[float],
        rewards: Sequence[float] | None = None,
        ground_truths: Sequence[Any] | None = None,
        *,
        split: str = "train",
        rows: Sequence[int] | None = None,
        episodes: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """Append the samples `rows` (default: all) of this step, whatever the step. `episodes`: per row, the
        multi-turn record to keep with it (conversation, num_turns, termination, tool_calls)."""
        n = len(prompts)
        columns = {"responses": responses, "scores": scores, "rewards": rewards, "ground_truths": ground_truths,
                   "episodes": episodes}
        bad = {k: len(v) for k, v in columns.items() if v is not None and len(v) != n}
        if bad:
            raise ValueError(f"rollout samples at step {step}: {n} prompts but column lengths {bad}; pass one per row")
        lines = []
        for i in range(n) if rows is None else rows:
            row: dict[str, Any] = {
                "step": int(step),
                "split": split,
                "index": i,
                "prompt": str(prompts[i]),
                "response": str(responses[i]),
                "score": float(scores[i]),
            }
            if rewards is not None:
                row["reward"] = float(rewards[i])
            if ground_truths is not None:
                row["ground_truth"] = _jsonable(ground_truths[i])
            if episodes is not None:
                row.update({k: _jsonable(v) for k, v in episodes[i].items()})
            lines.append(json.dumps(row, ensure_ascii=False) + "\n")
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(lines)

